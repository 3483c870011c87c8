"""Pipeline parallelism over torch.distributed: each rank runs a contiguous range of layers with its own store
and budgets (group.py: the ring links; pipeline.py: rank 0's side; worker.py: the other ranks'; engine.py:
opening a rank; launch.py: starting the ranks on one box; command.py: `run` under torchrun or --devices)."""
