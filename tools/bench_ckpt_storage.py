"""Checkpoint save and resume times: local disk against object storage (a local S3 server).

    python tools/bench_ckpt_storage.py [--model gpt-tiny gpt-125m] [--repeat 1] [--url s3://BUCKET/PREFIX]

Builds each model's weights and AdamW state in one process (fp32, as a checkpoint holds
them: 12 bytes a parameter) and times llmforge's own path: a synchronous save
(``CheckpointSaver``: DCP shards, JSON state, the manifest with every file's SHA-256, and
the rename or the manifest object that publishes it), finding the checkpoint with every
checksum checked (``locate``, what ``llmforge resume`` does before launch), and loading it
back into the model and optimizer (``store.load``). Without ``--url`` it starts moto's S3
server (its own process) on a free localhost port (credentials and endpoint from a throw-away environment);
with ``--url`` it uses the storage your environment points at. Prints one line per model and
place. Times on a busy machine vary by tens of percent: repeat, and compare lines of one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch


def _local_s3() -> tuple:
    """moto's S3 server in its own process (as a real server is: not sharing this process's
    interpreter lock with the hashing and serialisation measured here)."""
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(os.path.join(tempfile.gettempdir(), f"bench-moto-{port}.log"), "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_EC2_METADATA_DISABLED": "true",
            # fsspec's own settings for s3fs: the test server joins a large multipart upload
            # slowly on a busy machine, past botocore's 60 s read timeout
            "FSSPEC_S3": '{"config_kwargs": {"read_timeout": 900}}',
        }
    )
    import s3fs

    s3fs.S3FileSystem().mkdir("bench")
    return server, "s3://bench/ckpt"


def _model_and_optimizer(name: str):
    from llmforge.checkpoint.state import _init_optimizer_state
    from llmforge.config.compose import compose
    from llmforge.models.gpt import GPT

    config = compose([f"model={name}"]).model
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _init_optimizer_state(optimizer)
    return model, optimizer, sum(p.numel() for p in model.parameters())


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(name: str, *, root, model, optimizer, repeat: int) -> dict:
    from llmforge.checkpoint import store
    from llmforge.checkpoint.locate import locate

    saver = store.CheckpointSaver(root=root, keep=1, async_save=False, rank=0, log=lambda _: None)
    saves, finds, loads = [], [], []
    for step in range(1, repeat + 1):
        saves.append(
            _time(
                lambda: saver.save(
                    step=step,
                    model_parts=[model],
                    optimizer=optimizer,
                    train_state={"bench": True},
                    plan={"config": {"run": {"dir": "bench"}}},
                )
            )
        )
        where = str(root) + f"/step_{step}"
        finds.append(_time(lambda: locate(where)))
        loads.append(
            _time(lambda: store.load(path=where if isinstance(root, str) else Path(where), model_parts=[model], optimizer=optimizer))
        )
    saver.close()
    return {"save": min(saves), "verify": min(finds), "load": min(loads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["gpt-tiny", "gpt-125m"])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--url", default=None, help="object-storage prefix to use instead of a local moto server")
    args = parser.parse_args()
    server, url = (None, args.url) if args.url else _local_s3()
    local = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    try:
        for name in args.model:
            model, optimizer, params = _model_and_optimizer(name)
            size = params * 12 / 2**20
            for place, root in (("local disk", local / name), ("object storage", f"{url.rstrip('/')}/{name}")):
                t = bench(name, root=root, model=model, optimizer=optimizer, repeat=args.repeat)
                print(
                    f"{name:9s} {params / 1e6:7.1f}M params {size:7.0f} MiB  {place:15s} save {t['save']:6.2f}s "
                    f"({size / t['save']:6.0f} MiB/s)  verify {t['verify']:6.2f}s  load {t['load']:6.2f}s",
                    flush=True,
                )
            del model, optimizer
    finally:
        shutil.rmtree(local, ignore_errors=True)
        if server is not None:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
