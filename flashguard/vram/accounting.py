"""Where an engine's memory is, by category, from what the engine itself allocated.

GPU: weights (the model's parameters and buffers, counted once at load), kv cache (the live cache's device
tensors: a DynamicCache's K/V, or a TieredCache's window, sinks, summaries and hot pages), activations/workspace
(torch's allocated bytes minus the two), allocator slack (reserved minus allocated) and CUDA context/other
(NVML's figure for this process minus torch's reserved, where NVML is available; else absent).
Host: L2 pages in RAM, L3 pages on disk (bytes of the sealed files), the process's resident set.

Contract: ``engine_memory(engine)`` returns a JSON-ready dict; ``machine_memory()`` the same for the machine
(GPUs and their processes via NVML, host RAM, L3 folders of flashguard processes); ``render(...)`` a rich table.
"""

from __future__ import annotations

import os

import torch


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def model_bytes(model) -> int:
    return _tensor_bytes(list(model.parameters()) + [b for b in model.buffers() if b is not None])


def cache_device_bytes(cache) -> int:
    if cache is None:
        return 0
    from ..kv.cache import TieredCache

    if isinstance(cache, TieredCache):
        return cache.l1_bytes()
    out = []
    for layer in getattr(cache, "layers", []):
        out += [getattr(layer, "keys", None), getattr(layer, "values", None)]
    return _tensor_bytes(t for t in out if isinstance(t, torch.Tensor) and t.device.type != "cpu")


def nvml_process_bytes(device_index: int, pid: int) -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:  # NVML missing on this driver, or containerised pids: report nothing rather than guess
        return None
    return None


def folder_bytes(path: str | None) -> int:
    if not path or not os.path.isdir(path):
        return 0
    total = 0
    for name in os.listdir(path):
        try:
            total += os.path.getsize(os.path.join(path, name))
        except OSError:
            pass
    return total


def gpu_categories(device: torch.device, weights: int, kv: int) -> dict:
    """GPU bytes by category now: weights and KV as attributed by their owner, the rest from the allocator
    (activations/workspace = allocated - weights - kv; slack = reserved - allocated) and NVML (context/other)."""
    dev = device.index or 0
    allocated, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    out = {"weights": weights, "kv cache": kv, "activations/workspace": max(0, allocated - weights - kv),
           "allocator slack": reserved - allocated}
    nv = nvml_process_bytes(dev, os.getpid())
    if nv is not None:
        out["cuda context/other"] = max(0, nv - reserved)
    return out


def engine_memory(engine) -> dict:
    import psutil

    weights = model_bytes(engine.model)
    with engine.lock:
        kv = cache_device_bytes(engine.session.cache if engine.session is not None else None)
        if getattr(engine, "pool", None) is not None:   # buffers kept for the next session (kv/pool.py)
            kv += engine.pool.nbytes()
    out: dict = {"model": engine.source.label, "device": str(engine.device), "pid": os.getpid(),
                 "gpu": None, "host": {}}
    if engine.device.type == "cuda":
        dev = engine.device.index or 0
        out["gpu"] = {**gpu_categories(engine.device, weights, kv), "reserved": torch.cuda.memory_reserved(dev),
                      "peak reserved": torch.cuda.max_memory_reserved(dev),
                      "peak allocated": torch.cuda.max_memory_allocated(dev),
                      "budget": engine.vram_budget}
    else:
        out["cpu_weights"] = weights
        out["cpu_kv cache"] = kv
    store = engine.store
    if store is not None:
        counts = store.tier_counts()
        out["host"]["L2 pages"] = counts["l2_pages"]
        out["host"]["L2 bytes"] = counts["l2_bytes"]
        out["host"]["L3 pages"] = counts["l3_pages"]
        out["host"]["L3 disk bytes"] = folder_bytes(store.l3_dir)
    out["host"]["process RSS"] = psutil.Process().memory_info().rss
    out["info"] = engine.info()
    return out


def machine_memory() -> dict:
    """GPUs (NVML, else torch), host RAM, and L3 folders of flashguard processes in the temp dir."""
    import tempfile

    import psutil

    gpus = []
    try:
        import pynvml

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            procs = [{"pid": p.pid, "used": p.usedGpuMemory} for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
            gpus.append({"index": i, "name": pynvml.nvmlDeviceGetName(h), "total": mem.total, "used": mem.used,
                         "processes": procs})
    except Exception:
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(i)
                gpus.append({"index": i, "name": torch.cuda.get_device_name(i), "total": total,
                             "used": total - free, "processes": []})
    vm = psutil.virtual_memory()
    l3 = {}
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        if name.startswith("flashguard-l3-"):
            l3[os.path.join(tmp, name)] = folder_bytes(os.path.join(tmp, name))
    return {"gpus": gpus, "host": {"total": vm.total, "available": vm.available}, "l3_folders": l3}


def _gib(v) -> str:
    return f"{v / 2**30:.3f}" if isinstance(v, (int, float)) else str(v)


def render(report: dict) -> str:
    """Plain-text tables (also what ``rich`` prints) for a server/engine report or a machine report."""
    lines = []
    if "gpus" in report:
        if not report["gpus"]:
            lines.append("no GPU visible to this process (torch.cuda.is_available() is False)")
        for g in report["gpus"]:
            lines.append(f"GPU {g['index']} {g['name']}: {_gib(g['used'])} / {_gib(g['total'])} GiB used")
            lines += [f"  pid {p['pid']}: {_gib(p['used'] or 0)} GiB" for p in g["processes"]]
        lines.append(f"host RAM: {_gib(report['host']['available'])} GiB available of {_gib(report['host']['total'])}")
        for path, size in report["l3_folders"].items():
            lines.append(f"L3 folder {path}: {_gib(size)} GiB")
    for eng in report.get("engines", []):
        lines.append(f"engine {eng['model']} on {eng['device']} (pid {eng['pid']})")
        info = eng.get("info") or {}
        if info:
            budget = info.get("vram_budget")
            lines.append(f"  weights {info['weights']} ({info.get('int4_kernel') or 'float'}), cache {info['cache']}, "
                         f"context {info['context']}, vram_budget {_gib(budget) + ' GiB' if budget else 'none'}")
            head = (info.get("placement") or {}).get("lm_head") or {}
            read = info.get("decode_bytes") or {}
            if read:
                lines.append(f"  read per decoded token at the full context: {read['total'] / 1e9:.3f} GB (decoder "
                             f"linears {read['decoder linears'] / 1e9:.3f}, lm_head {read['lm_head'] / 1e9:.3f} "
                             f"({head.get('weights', '?')}), K/V {read['kv attended'] / 1e9:.3f})")
        for tier, t in (info.get("tiers") or {}).items():
            if isinstance(t, dict):
                extra = ", ".join(f"{k} {v}" for k, v in t.items() if k != "tokens" and v is not None)
                lines.append(f"  {tier}: {t.get('tokens')} tokens ({extra})")
        lines.append("| category | GiB |")
        lines.append("|---|---|")
        for k, v in (eng["gpu"] or {}).items():
            if v is not None:
                lines.append(f"| GPU {k} | {_gib(v)} |")
        for k in ("cpu_weights", "cpu_kv cache"):
            if k in eng:
                lines.append(f"| {k.replace('cpu_', 'CPU ')} | {_gib(eng[k])} |")
        for k, v in eng["host"].items():
            lines.append(f"| host {k} | {v if 'pages' in k else _gib(v)} |")
    return "\n".join(lines) + "\n"
