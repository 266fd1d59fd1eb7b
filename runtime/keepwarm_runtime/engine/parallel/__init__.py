"""Tensor and expert parallel: one process per rank, each holding its shard of the model.

``group``: the process group a rank joins before its weights load; ``layers``: the collectives the
sharded model's layers run (one all-reduce per row-parallel layer, the vocabulary-parallel embedding
and LM head, experts partitioned or split); ``step``: rank 0's step inputs broadcast to the other
ranks; ``runner``: rank 0's model runner that shares each step; ``follower``: the loop of ranks 1..N-1;
``launch``: starting the ranks of an offline ``LLM`` and of a supervised server. The split itself, the
same for the cache daemon and the engine, is ``weights.tensor_parallel``.
"""
