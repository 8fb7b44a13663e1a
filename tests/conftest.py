"""Shared, session-scoped test fixtures: a real corpus, a small tokenizer, megatron-core shards.

Other test files (trainer, evaluation) may reuse these; they are cheap after the first build:

* ``minipile_dir``      make_corpus output (Pile jsonl.zst: train/00, val, test; ~80 MB of text)
* ``tokenizer_model``   an 8k-piece BPE SentencePiece model trained on a 2 MB sample of it
* ``minipile_shards``   {"train": PREFIX, "val": PREFIX} .bin/.idx/.counts.npy/.manifest.json
                        of minipile train/00 and val with ``tokenizer_model`` (uint16, EOD = 2)
* ``tokenizer_model_200k``  a 200k-piece model (int32 shards), trained on ~12 MB (slower: ~15 s)
* ``run_cli``           run ``python -m MODULE ARGS`` in a subprocess with a timeout
* ``tokenize``          run ``python -m data_prep.tokenize --input ... --tokenizer ... --output-prefix ...``

Built artifacts live under ``$LEVIATHAN_TEST_CACHE`` (set by scripts/test.sh; a pytest temp dir
otherwise), keyed by a hash of the code that makes them, built under a temporary name and renamed
into place, so concurrent sessions and stale caches are safe.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests import tiers

# Triton's interpreter for the GPU kernels under test (Liger-Kernel's cross entropy: model.loss_impl=liger): Triton
# reads TRITON_INTERPRET when a @triton.jit kernel is defined, i.e. when its module is imported, so it is set here,
# before any test module imports triton or liger_kernel (nothing imported above, nor pytest's plugins, does: checked
# by tests/test_loss_liger.py). Worker processes inherit it. setdefault: TRITON_INTERPRET=0 in the environment runs
# the kernels compiled (a GPU machine).
os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
DATA_PREP = REPO / "data_prep"
_CPU = pytest.StashKey[float]()  # a test phase's CPU seconds (pytest_runtest_setup/call/teardown below)


def code_key(*names: str, extra: str = "") -> str:
    """Hash of data_prep source files (and ``extra``): a changed builder means a fresh artifact."""
    h = hashlib.sha256(extra.encode())
    for name in names:
        h.update((DATA_PREP / name).read_bytes())  # a name may be a path under data_prep/
    h.update(sys.version.encode())
    return h.hexdigest()[:12]


def build_once(root: Path, name: str, build) -> Path:
    """Return ``root/name``, building it with ``build(tmp_dir)`` if missing (tmp dir, then rename)."""
    final = root / name
    if final.exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:  # test processes running side by side build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.exists():
            return final
        return _build(root, name, final, build)


def _build(root: Path, name: str, final: Path, build) -> Path:
    tmp = root / f"{name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another session finished first: use theirs
            if not final.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # keep the cache small: of older builds of the same kind, keep only the newest other one
    kind = name.rsplit("-", 1)[0]
    others = sorted(
        (p for p in root.glob(f"{kind}-*") if p != final and ".tmp-" not in p.name),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in others[1:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _run(args, timeout=300, check=True, env=None, cwd=None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.setdefault("PYTHONPATH", str(REPO))
    if env:
        e.update(env)
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=e, cwd=cwd or REPO)
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        )
    return p


def run_module(module: str, *args, timeout=300, check=True, env=None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", module, *map(str, args)], timeout=timeout, check=check, env=env)


def run_tokenize(inputs, tokenizer, prefix, *args, timeout=300, check=True, env=None) -> subprocess.CompletedProcess:
    """``python -m data_prep.tokenize --input INPUTS --tokenizer TOKENIZER --output-prefix PREFIX ARGS``;
    ``inputs``: one path or a list of them."""
    inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    return run_module(
        "data_prep.tokenize",
        "--input",
        *inputs,
        "--tokenizer",
        tokenizer,
        "--output-prefix",
        prefix,
        *args,
        timeout=timeout,
        check=check,
        env=env,
    )


@pytest.fixture(scope="session")
def run_cli():
    """``run_cli("data_prep.tokenize", "--input", ..., timeout=120, check=True)``."""
    return run_module


@pytest.fixture(scope="session")
def tokenize():
    """``tokenize(src, tokenizer_model, prefix, "--workers", 2, timeout=120, check=False)``."""
    return run_tokenize


@pytest.fixture(scope="session")
def test_cache(tmp_path_factory) -> Path:
    root = os.environ.get("LEVIATHAN_TEST_CACHE")
    path = Path(root) / "data_prep" if root else tmp_path_factory.mktemp("data_prep_cache")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def minipile_dir(test_cache) -> Path:
    """The make_corpus corpus (all three sources): train/00.jsonl.zst, val.jsonl.zst, test.jsonl.zst."""
    key = code_key("make_corpus.py", "small_corpus.py")
    return build_once(
        test_cache, f"minipile-{key}", lambda tmp: run_module("data_prep.make_corpus", tmp, "--force", timeout=600)
    )


def _tokenizer(test_cache: Path, minipile_dir: Path, vocab: int, sample_mb: int, name: str) -> Path:
    """A BPE tokenizer.model trained on a seeded ``sample_mb`` MB sample of minipile train, cached."""
    key = code_key(
        "train_tokenizer.py",
        "tokenizer_training.py",
        "tokenizer_sample.py",
        "sources.py",
        "pile_sets.py",
        "input_files.py",
        "bounded_lines.py",
        extra=minipile_dir.name,
    )

    def build(tmp):
        run_module(
            "data_prep.train_tokenizer",
            "--input",
            minipile_dir / "train" / "00.jsonl.zst",
            "--vocab-size",
            vocab,
            "--sample-bytes",
            sample_mb,
            "--output",
            tmp,
            "--overwrite",
            timeout=600,
        )

    return build_once(test_cache, f"{name}-{key}", build) / "tokenizer.model"


@pytest.fixture(scope="session")
def tokenizer_model(test_cache, minipile_dir) -> Path:
    """8k BPE tokenizer.model trained on a 2 MB seeded sample of minipile train."""
    return _tokenizer(test_cache, minipile_dir, 8000, 2, "tokenizer8k")


@pytest.fixture(scope="session")
def tokenizer_model_200k(test_cache, minipile_dir) -> Path:
    """200k BPE tokenizer.model (vocab > 65536: int32 shards) trained on a 12 MB sample."""
    return _tokenizer(test_cache, minipile_dir, 200000, 12, "tokenizer200k")


@pytest.fixture(scope="session")
def data_prep_code_key() -> str:
    return code_key(*sorted(str(p.relative_to(DATA_PREP)) for p in DATA_PREP.rglob("*.py")))


@pytest.fixture(scope="session")
def gpt2_tiktoken() -> Path:
    """GPT-2's published ranks file (tiktoken's r50k_base: 50,256 ranks + <|endoftext|>), from openai-whisper."""
    from tests.tokenizer_kinds import asset

    return asset("gpt2.tiktoken")


@pytest.fixture(scope="session")
def bpe_tokenizer_json(test_cache, minipile_dir, read_corpus) -> Path:
    """A 4k byte-level BPE tokenizer.json trained here with ``tokenizers`` on minipile train's first 2 MB."""
    from tests.tokenizer_kinds import train_bpe

    def build(tmp):
        texts, size = [], 0
        for r in read_corpus(minipile_dir / "train" / "00.jsonl.zst"):
            texts.append(r["text"])
            size += len(r["text"])
            if size > 2_000_000:
                break
        train_bpe(texts, tmp)

    key = hashlib.sha256(f"{minipile_dir.name}{(REPO / 'tests' / 'tokenizer_kinds.py').read_bytes()}".encode())
    return build_once(test_cache, f"bpe4k-{key.hexdigest()[:12]}", build) / "tokenizer.json"


@pytest.fixture(scope="session")
def big_tiktoken(test_cache, gpt2_tiktoken, minipile_dir, read_corpus) -> Path:
    """A test-made ranks file with 70,257 ids (int32 shards; needs --tiktoken-pattern r50k): GPT-2's plus merges
    frequent in minipile val."""
    from tests.tokenizer_kinds import write_big_ranks

    def build(tmp):
        texts = [r["text"] for r in read_corpus(minipile_dir / "val.jsonl.zst")[:500]]
        write_big_ranks(gpt2_tiktoken, texts, tmp / "big.tiktoken")

    key = hashlib.sha256(f"{minipile_dir.name}{(REPO / 'tests' / 'tokenizer_kinds.py').read_bytes()}".encode())
    return build_once(test_cache, f"big-ranks-{key.hexdigest()[:12]}", build) / "big.tiktoken"


@pytest.fixture(scope="session")
def minipile_shards(test_cache, minipile_dir, tokenizer_model, data_prep_code_key) -> dict:
    """{"train": PREFIX, "val": PREFIX}: megatron-core shards of minipile train/00 and val."""
    key = hashlib.sha256(f"{data_prep_code_key}{tokenizer_model.parent.name}{minipile_dir.name}".encode()).hexdigest()[
        :12
    ]

    def build(tmp):
        for split, src in (("train", minipile_dir / "train" / "00.jsonl.zst"), ("val", minipile_dir / "val.jsonl.zst")):
            run_tokenize(src, tokenizer_model, tmp / split, "--workers", 2, timeout=600)

    d = build_once(test_cache, f"shards-{key}", build)
    return {"train": str(d / "train"), "val": str(d / "val")}


def read_jsonl_zst(path) -> list[dict]:
    """All records of a (small) jsonl.zst file - test helper, holds the file in memory."""
    import orjson
    import zstandard

    with open(path, "rb") as f:
        data = zstandard.ZstdDecompressor().stream_reader(f).read()
    return [orjson.loads(line) for line in data.split(b"\n") if line]


@pytest.fixture(scope="session")
def read_corpus():
    return read_jsonl_zst


# Tests that share one process under pytest-xdist (scripts/test.sh runs several): a file's tests stay together (its
# module fixtures are built once), and so do the files of a group: the trainer ones share
# tests/workers/train_common.py's cached launches (a file calling one must be listed here, or its process runs them
# again: tests/test_suite_groups.py). The SLURM files are not grouped: a process that runs one starts a test cluster of
# its own (the ``slurm_cluster`` fixture: under a second), so they run side by side in different processes, on
# different clusters. The files in EACH_TEST go test by test: test_slurm_faults.py's faults, each a job on the two
# nodes that mostly waits on timeouts, run beside the other tests rather than one after the other.
GROUPS = {
    "trainer": (
        "test_checkpoint.py",
        "test_train.py",
        "test_grad_accum.py",
        "test_compile.py",
        "test_data_cache.py",
        "test_data_loader.py",
        "test_metrics.py",
        "test_recompute_tp.py",
        "test_sequence_parallel.py",
    ),
}
GROUP_OF = {f: g for g, files in GROUPS.items() for f in files}
EACH_TEST = ("test_slurm_faults.py",)
# The order the scopes are handed out in: the longest first (measured in CI: the durations summary at the end of
# make test), so that none of them, started last, ends the run alone; the rest in collection order.
LONG = (
    "trainer",
    "test_repro_small.py",
    "test_slurm.py",
    "test_evaluate.py",
    "test_slurm_faults.py",
    "test_ckpt_safety.py",
    "test_chaos.py",
    "test_export_hf.py",
    "test_setup_keep_torch.py",
    "test_train_launcher.py",
    "test_tutorial.py",
    "test_ckpt_errors.py",
    "test_hf_tokenizer_export.py",
    "test_tokenizer_kinds_train.py",
)


def _group(nodeid: str) -> str:
    """The file's group, or the file."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return GROUP_OF.get(name, name)


def _scope(nodeid: str) -> str:
    """What one xdist process runs together: the file's group, or the file, or (EACH_TEST) the test alone."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return nodeid if name in EACH_TEST else _group(nodeid)


def pytest_collection_modifyitems(config, items):
    tiers.mark(items)  # the integration marker (tests/tiers.py)
    order = {g: i for i, g in enumerate(LONG)}
    items.sort(key=lambda item: order.get(_group(item.nodeid), len(order)))  # stable: files keep their order


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with our scopes (:func:`_scope`). (Its ``loadgroup`` mode cannot be used: with
    pytest 9.2 the ``@group`` suffix xdist 3.8.0 writes into a test's ``_nodeid`` no longer reaches its id.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False  # our order (the long scopes first), not xdist's most-tests-first
    return FileGroups(config, log)


@pytest.fixture(autouse=True)
def _fast_tier_guard(monkeypatch):
    if tiers.fast_tier():
        tiers.forbid_subprocesses(monkeypatch)
    yield


def pytest_configure(config):
    # megatron-core warns at import on machines without Transformer Engine / Apex (CPU): expected here.
    config.addinivalue_line("filterwarnings", "ignore:Transformer Engine and Apex are not installed")


def _cpu_s() -> float:
    """CPU seconds of this process and of every process it waited for (its subprocesses and theirs; not the jobs
    SLURM runs, whose parent is a slurmd)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU] = _cpu_s()
    yield
    item.stash[_CPU] = _cpu_s() - item.stash[_CPU]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item):
    item.stash[_CPU] = _cpu_s()
    yield
    item.stash[_CPU] = _cpu_s() - item.stash[_CPU]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_teardown(item):
    item.stash[_CPU] = _cpu_s()
    yield
    item.stash[_CPU] = _cpu_s() - item.stash[_CPU]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The phase's CPU seconds (:func:`_cpu_s`) ride on its report to the controlling process (``cpu_s``)."""
    outcome = yield
    if _CPU in item.stash:
        outcome.get_result().user_properties.append(("cpu_s", round(item.stash[_CPU], 2)))


def pytest_runtest_logreport(report):
    """Every test phase's seconds into ``$LEVIATHAN_TEST_DURATIONS`` (set by scripts/test.sh), written by the
    controlling process (under xdist the workers' reports reach it); summarized by tests/durations.py."""
    path = os.environ.get("LEVIATHAN_TEST_DURATIONS")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        from tests import durations

        node = getattr(report, "node", None)  # xdist: the worker that ran it
        worker = getattr(getattr(node, "gateway", None), "id", "-")
        durations.record(path, "fast" if tiers.fast_tier() else "integration", worker, report)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real two-node SLURM cluster (tests/slurm_cluster.py: each node a network namespace with its own address and
    host name) for this test process (each xdist process that runs a SLURM test starts its own, in under a second;
    see GROUPS); ``SLURM_CONF`` points the client commands at it; the returned dict also names the
    nodes (``LEV_TEST_NODES``, comma-separated). If it cannot start, every test using it fails with the reason
    (never skipped); a cluster left by a killed session is cleaned first."""
    from tests import slurm_cluster

    state = Path(tempfile.mkdtemp(prefix="lev-slurm-"))
    try:
        env = slurm_cluster.start(state, nodes=2)
    except slurm_cluster.ClusterError as e:
        slurm_cluster.stop(state)
        pytest.fail(f"the test SLURM cluster did not start: {e}", pytrace=False)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]
    try:
        yield env
    finally:
        slurm_cluster.drain()  # cancel what is left and wait for its processes: none outlives the session
        slurm_cluster.stop(state)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
def trained_run(test_cache, minipile_shards, tokenizer_model):
    """``trained_run(name)`` -> the run directory of a small trained run of tests/trained.py (``lev-tp2``,
    ``tied-tp2``, ``untied-pp2``, ``lev-z3dp2``), trained on first use and cached."""
    from tests import trained

    cache = test_cache.parent / "trained"
    return lambda name: trained.train_run(name, cache, minipile_shards, tokenizer_model)
