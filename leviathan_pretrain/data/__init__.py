"""The trainer's input: data_prep's shards and tokenizer, as the training and evaluation read them.

- :mod:`.datasets`     shard checks, megatron-core ``GPTDataset`` blends, ``Batches`` (sample i is always train[i])
- :mod:`.index_cache`  megatron-core's dataset index cache: where it is, its files, the stamp
- :mod:`.index_cache_build`  the cache built ahead of training (``build_data_cache``): shard checks, index files
                             staged and renamed into place, the stamp; the report of its steps and files
- :mod:`.tokenizer`    ``data.tokenizer`` of any kind data_prep reads, opened once (torch-free)
- :mod:`.transfer`     a micro-batch on its way to the device: one packed host buffer, one copy, host unique ids
- :mod:`.prefetch`     the next global batch built on a background thread while the current step runs
"""
