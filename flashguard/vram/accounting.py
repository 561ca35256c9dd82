"""Where an engine's memory is, by category, from what the engine itself allocated.

GPU: weights (the model's parameters and buffers, counted once at load), kv cache (the live cache's device
tensors: a DynamicCache's K/V, or a TieredCache's window, sinks, summaries and hot pages), activations/workspace
(torch's allocated bytes minus the two), allocator slack (reserved minus allocated) and CUDA context/other
(NVML's figure for this process minus torch's reserved, where NVML is available; else absent).
Host: L2 pages in RAM, L3 pages on disk (bytes of the sealed files), the process's resident set.

Contract: ``engine_memory(engine)`` returns a JSON-ready dict; ``machine_memory(pids)`` the same for the machine
(GPUs and their processes via NVML, host RAM, the L3 folders of the processes ``pids``: by default this one's, never
another flashguard process's); ``render(...)`` plain text: sizes in GiB, counts of tokens and pages in words.
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


def gpu_categories(device: torch.device, weights: int, kv: int, guard: int = 0) -> dict:
    """GPU bytes by category now: weights, the guard adapter and KV as attributed by their owner, the rest from the
    allocator (activations/workspace = allocated - weights - guard - kv; slack = reserved - allocated) and NVML
    (context/other)."""
    dev = device.index or 0
    allocated, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    out = {"weights": weights, "guard adapter": guard, "kv cache": kv,
           "activations/workspace": max(0, allocated - weights - guard - kv), "allocator slack": reserved - allocated}
    nv = nvml_process_bytes(dev, os.getpid())
    if nv is not None:
        out["cuda context/other"] = max(0, nv - reserved)
    return out


def engine_memory(engine) -> dict:
    import psutil

    weights = model_bytes(engine.model)
    guard = engine.guard.bytes if getattr(engine, "guard", None) is not None and hasattr(engine.guard, "bytes") else 0
    with engine.lock:
        kv = cache_device_bytes(engine.session.cache if engine.session is not None else None)
        if getattr(engine, "pool", None) is not None:   # buffers kept for the next session (kv/pool.py)
            kv += engine.pool.nbytes()
    out: dict = {"model": engine.source.label, "device": str(engine.device), "pid": os.getpid(),
                 "gpu": None, "host": {}}
    if engine.device.type == "cuda":
        dev = engine.device.index or 0
        out["gpu"] = {**gpu_categories(engine.device, weights, kv, guard), "reserved": torch.cuda.memory_reserved(dev),
                      "peak reserved": torch.cuda.max_memory_reserved(dev),
                      "peak allocated": torch.cuda.max_memory_allocated(dev),
                      "budget": engine.vram_budget}
    else:
        out["cpu_weights"] = weights
        out["cpu_guard adapter"] = guard
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


def l3_folder_owner(path: str) -> int | None:
    """The pid an L3 folder was made for (its ``owner.pid``, kv/disk.py), or None where it says none."""
    try:
        with open(os.path.join(path, "owner.pid")) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def machine_memory(pids=None) -> dict:
    """GPUs (NVML, else torch), host RAM, and the L3 folders in the temp dir that the processes ``pids`` (default:
    this one) made: not other flashguard processes' (another user's server, a crashed run's leftovers)."""
    pids = {os.getpid()} if pids is None else set(pids)
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
        if name.startswith("flashguard-l3-") and l3_folder_owner(os.path.join(tmp, name)) in pids:
            l3[os.path.join(tmp, name)] = folder_bytes(os.path.join(tmp, name))
    return {"gpus": gpus, "host": {"total": vm.total, "available": vm.available}, "l3_folders": l3}


def _gib(v) -> str:
    return f"{v / 2**30:.3f}" if isinstance(v, (int, float)) else str(v)


def _tier_line(tier: str, t: dict) -> str:
    """One cache tier of ``engine.info()["tiers"]`` in words."""
    tokens = t.get("tokens")
    if tier == "pool":
        return f"KV pool: {tokens} tokens in {t.get('codec')}, {_gib(t.get('bytes') or 0)} GiB"
    if tier == "l1":
        return (f"L1 (the window kept in the pool): {tokens} tokens, the first {t.get('sink_tokens')} always kept; "
                f"{_gib(t.get('bytes_now') or 0)} GiB in use now")
    if tier == "l2":
        return (f"L2 (host RAM): up to {tokens} tokens in {t.get('codec')}; now {t.get('pages_now')} pages, "
                f"{_gib(t.get('bytes_now') or 0)} GiB")
    if tier == "l3":
        where = f" in {t['dir']}" if t.get("dir") else ""
        error = f"; error: {t['error']}" if t.get("error") else ""
        return f"L3 (disk): up to {tokens} tokens in {t.get('codec')}; now {t.get('pages_now')} pages{where}{error}"
    extra = ", ".join(f"{k} {v}" for k, v in t.items() if k != "tokens" and v is not None)
    return f"{tier}: {tokens} tokens ({extra})"


HOST_ROWS = {"L2 bytes": "L2 pages in host RAM", "L3 disk bytes": "L3 pages on disk",
             "process RSS": "the process's resident memory (RAM)"}


def render(report: dict) -> str:
    """Plain text (also what ``rich`` prints) for a server/engine report or a machine report: the table holds
    sizes only, in GiB; tokens and page counts are said in words on the tiers' lines."""
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
            kernel = f" ({info['int4_kernel']} kernel)" if info.get("int4_kernel") else ""
            lines.append(f"  weights {info['weights']}{kernel}, cache {info['cache']}, context {info['context']} tokens, "
                         f"GPU budget (vram_budget) {_gib(budget) + ' GiB' if budget else 'none'}")
            head = (info.get("placement") or {}).get("lm_head") or {}
            read = info.get("decode_bytes") or {}
            if read:
                lines.append(f"  read per decoded token at the full context: {read['total'] / 1e9:.3f} GB (decoder "
                             f"linears {read['decoder linears'] / 1e9:.3f}, lm_head {read['lm_head'] / 1e9:.3f} "
                             f"({head.get('weights', '?')}), K/V {read['kv attended'] / 1e9:.3f})")
        for tier, t in (info.get("tiers") or {}).items():
            if isinstance(t, dict):
                lines.append("  " + _tier_line(tier, t))
        lines.append("| memory | GiB |")
        lines.append("|---|---|")
        for k, v in (eng["gpu"] or {}).items():
            if v is not None:
                lines.append(f"| GPU {k} | {_gib(v)} |")
        for k in ("cpu_weights", "cpu_guard adapter", "cpu_kv cache"):
            if k in eng:
                lines.append(f"| {k.replace('cpu_', 'CPU ').replace('kv', 'KV')} | {_gib(eng[k])} |")
        for k, v in eng["host"].items():
            if "pages" not in k:   # (counts: on the tiers' lines above)
                lines.append(f"| {HOST_ROWS.get(k, 'host ' + k)} | {_gib(v)} |")
    return "\n".join(lines) + "\n"
