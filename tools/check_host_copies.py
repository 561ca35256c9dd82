"""How long the decoding thread's copy of one L2 page takes while reader threads unpack pages (issue 13).

    python tools/check_host_copies.py [--readers 2] [--seconds 2]

One page of the DeepSeek-R1-Distill-Qwen-1.5B shape (28 layers, 2 KV heads, 64 tokens, head_dim 128) in the int8
L2 layout: its rows are copied into an arena slot again and again, by torch's ``copy_`` and by numpy's ``copyto``,
alone and while ``--readers`` threads read int4 page files back (the torch path: ``from_bytes`` + ``transcode`` +
``rows``; the numpy one: ``codecs.int4_as_int8_rows``). Prints the mean and worst copy time of each pairing: torch's
copy wakes its OpenMP pool for every page, whose threads wait on cores the readers (or other processes) keep busy.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import torch

from flashguard.kv import codecs
from flashguard.kv.store import L2Arena


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args(argv)
    k, v = torch.randn(28, 2, 64, 128), torch.randn(28, 2, 64, 128)
    blob = codecs.to_bytes(codecs.encode(k, v, "int4"))
    arena = L2Arena(pin=False)
    for _ in range(8):
        arena.write(codecs.encode(k, v, "int8"))
    readers = {"none": None,
               "torch": lambda: arena.rows(codecs.transcode(codecs.from_bytes(blob), "int8")),
               "numpy": lambda: codecs.int4_as_int8_rows(blob, arena.layout, arena.row_bytes)}
    rows = readers["torch"]()
    copies = {"torch copy_": lambda: arena.data[:, 5].copy_(rows),
              "numpy copyto": lambda: np.copyto(arena.host[:, 5], rows.numpy())}
    print(f"torch threads {torch.get_num_threads()}, {args.readers} reader threads")
    print("| copy | readers | mean ms | worst ms | pages read |\n|---|---|---|---|---|")
    for copy_name, copy in copies.items():
        for reader_name, read in readers.items():
            stop, done = threading.Event(), [0]

            def reader(read=read):
                while not stop.is_set():
                    read()
                    done[0] += 1

            threads = [threading.Thread(target=reader) for _ in range(args.readers if read else 0)]
            for t in threads:
                t.start()
            n, worst, t0 = 0, 0.0, time.perf_counter()
            while time.perf_counter() - t0 < args.seconds:
                a = time.perf_counter()
                copy()
                worst = max(worst, time.perf_counter() - a)
                n += 1
            mean = (time.perf_counter() - t0) / n
            stop.set()
            for t in threads:
                t.join()
            print(f"| {copy_name} | {reader_name} | {mean * 1e3:.3f} | {worst * 1e3:.3f} | {done[0]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
