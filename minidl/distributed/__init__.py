"""Data parallelism over MPI: the communicator, DataParallel, ZeRO sharding."""
