"""lm-evaluation-harness's own CLI with the ``leviathan`` model registered; it takes lm_eval's arguments.

  python -m leviathan_pretrain.lm_eval --model leviathan --model_args run=RUN_DIR,step=N,device=cuda \\
      --tasks hellaswag,arc_easy,arc_challenge,piqa,winogrande,lambada_openai --batch_size 8

lm-eval 0.4.13 has no plugin entry points for models: the stock ``lm_eval`` command knows only the models under
``lm_eval.models``, so this entry point imports :mod:`leviathan_pretrain.evaluation.lm_eval_adapter` (which
registers ``leviathan``) and then runs ``lm_eval.__main__.cli_evaluate`` on the same command line. Run it with
``-m``: run as a file, this module's directory would shadow the ``lm_eval`` package. See docs/lm_eval.md.
"""

from __future__ import annotations


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    import leviathan_pretrain.evaluation.lm_eval_adapter  # noqa: F401  registers the "leviathan" model

    cli_evaluate()


if __name__ == "__main__":
    main()
