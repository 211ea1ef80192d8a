"""gloo all-reduce latency between two processes with one or two threads
per ProcessGroupGloo (run with the project's venv)."""

import datetime
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, size: int, port: int, n: int, threads: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=30)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._threads = threads
    group = dist.ProcessGroupGloo(store, rank, size, opts)
    for shape in [(1, 1024), (8, 1024)]:
        x = torch.randn(shape)
        for _ in range(20):
            group.allreduce([x]).wait()
        start = time.perf_counter()
        for _ in range(n):
            group.allreduce([x]).wait()
        if rank == 0:
            print(threads, shape, f"{(time.perf_counter() - start) / n * 1e6:.0f} us", flush=True)


if __name__ == "__main__":
    for threads in (1, 2):
        mp.spawn(run, args=(2, 29600 + threads, 300, threads), nprocs=2)
