"""Tensor and expert parallelism: the model sharded over ranks with torch.distributed.

    communicator.py      the `Communicator` interface the model calls (and the null one for one rank)
    process_group_comm.py  gloo (CPU) and NCCL (GPU) communicators over a torch.distributed group
    symm_mem_comm.py     torch symmetric-memory one-shot / two-shot all-reduce (small single-node messages)
    comm_choice.py       `choose_communicator`: the one rule that picks an implementation per message
    expert_sharding.py   `ExpertSharding`: which experts and which slice of each a rank holds
    sharding.py          `ShardingPlan`: the per-rank config and which checkpoint tensor is split how
    vocab_parallel.py    the vocabulary-parallel embedding and lm_head
    loader.py            reads a rank's slices from the safetensors shards; for rank 0's draft, the whole embed/lm_head
    control.py           rank 0's step messages to the followers, and the heartbeat
    worker.py            rank processes: spawn, follow, monitor, stop; `build_tp_engine` for mstar-serve
    rendezvous.py        the multi-node contract (torchrun's flags and environment): nodes, node rank, master
    launch.py            the launcher of a node other than node 0: join node 0's store, run and watch its ranks
    node_beats.py        each node's beat in the store, and its watch over the nodes it depends on
"""
