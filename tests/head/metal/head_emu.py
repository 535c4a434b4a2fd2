"""The Metal head's launch plans, run on the emulator.

plan() asks csrc/metal/plan.cpp (through tests/head/metal/plan_dump.cpp) for the
launches the Metal host encodes; run_plan() runs exactly those launches on
the emulated kernels of metal/flash_cce.metal, with the plan's scratch buffers
filled with NaN so that a kernel reading scratch nobody wrote shows up.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np

import emu_env
import metal_emu

ROOT = Path(__file__).resolve().parents[3]
METAL = ROOT / "metal"
SOURCE = METAL / "flash_cce.metal"
CACHE = ROOT / "build" / "metal-emu"
PLAN_SOURCES = [ROOT / "tests/head/metal/plan_dump.cpp", ROOT / "csrc/metal/plan.cpp",
                ROOT / "csrc/metal/kernel_source.cpp", ROOT / "csrc/metal/plan.h",
                ROOT / "csrc/metal/kernel_source.h", METAL / "params.h"]
# Storage of each dtype in the host arrays: bfloat16 as its 16 bits.
STORAGE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}


# --- The plan ---------------------------------------------------------------

def _plan_tool() -> Path:
    h = hashlib.sha256()
    for p in PLAN_SOURCES:
        h.update(p.read_bytes())
    exe = CACHE / f"plan_dump-{h.hexdigest()[:16]}"
    if not exe.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        cxx = shutil.which("c++") or metal_emu.find_compiler()
        tmp = exe.with_suffix(f".{os.getpid()}.tmp")  # parallel workers build it too
        subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(ROOT / "csrc"),
                        *[str(p) for p in PLAN_SOURCES if p.suffix == ".cpp"], "-o", str(tmp)],
                       check=True)
        tmp.rename(exe)
    return exe


def plan(pass_: str, M: int, H: int, V: int, *, h="f32", w="f32", sb="f32", out="f32",
         quantized=False, bits=4, group_size=64, softcap=0.0, ignore_index=-100,
         fused=False, compute_dw=False, max_splits=0, dw_slab_rows=0, round_blocks=0,
         round_m_tiles=0, acc_registers=0, stats=False) -> dict:
    args = [pass_, M, H, V, h, w, sb, out, int(quantized), bits, group_size, softcap,
            ignore_index, int(fused), int(compute_dw), max_splits, dw_slab_rows, round_blocks,
            round_m_tiles, acc_registers, int(stats)]
    proc = subprocess.run([str(_plan_tool()), *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ValueError(proc.stderr.strip())
    return json.loads(proc.stdout)


def select_kernels(source_path: Path, kernels) -> str:
    """The Metal host's per-configuration source (csrc/metal/kernel_source.h)
    for `kernels`, cut from the inlined source at `source_path`."""
    proc = subprocess.run([str(_plan_tool()), "--select", str(source_path), *sorted(kernels)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ValueError(proc.stderr.strip())
    return proc.stdout


def kernel_names() -> list[str]:
    out = subprocess.run([str(_plan_tool()), "--names"], capture_output=True, text=True,
                         check=True).stdout
    return out.split()


def param_fields() -> list[tuple[str, str]]:
    """(type, name) of FcceParams's fields in declaration order, from params.h."""
    text = (METAL / "params.h").read_text()
    body = re.search(r"struct FcceParams \{(.*?)\};", text, re.S).group(1)
    return re.findall(r"^\s*(int|float) (\w+);", body, re.M)


def params_bytes(params: dict) -> bytes:
    fields = param_fields()
    if [n for _, n in fields] != list(params):
        raise ValueError(f"plan params {list(params)} do not match params.h {fields}")
    fmt = "<" + "".join("i" if t == "int" else "f" for t, _ in fields)
    return struct.pack(fmt, *(params[n] for _, n in fields))


# --- The kernels ------------------------------------------------------------

def host_names(text: str) -> list[str]:
    """Entry point names: host_name instantiations and plain fcce_ kernels."""
    return (re.findall(r'^template \[\[host_name\("([^"]+)"\)\]\]', text, re.M)
            + re.findall(r"^\[\[kernel\]\].* void (fcce_\w+)\(", text, re.M))


def kernel_source(kernels=None) -> str:
    """metal/flash_cce.metal with the project's own headers inlined (so that a
    mutation can reach them) and, when `kernels` is given, only those entry
    points instantiated."""
    text = SOURCE.read_text()

    def inline(m: re.Match) -> str:
        path = METAL / m.group(1)
        return path.read_text() if path.exists() else m.group(0)

    for _ in range(2):  # the headers include nothing of ours in turn; twice is plenty
        text = re.sub(r'^#include "([\w.]+)"$', inline, text, flags=re.M)
    if kernels is not None:
        kernels = set(kernels)
        missing = kernels - set(host_names(text))
        kernels |= set(re.findall(r"^\[\[kernel\]\].* void (fcce_\w+)\(", text, re.M))
        if missing:
            raise ValueError(f"not in {SOURCE.name}: {sorted(missing)}")
        text = "\n".join(
            line for line in text.splitlines()
            if not line.startswith("template [[host_name(")
            or host_names(line)[0] in kernels) + "\n"
    return text


def build(kernels=None, *, source: str | None = None, mode: str = "run") -> metal_emu.Program:
    return emu_env.build(source if source is not None else kernel_source(kernels), mode=mode)


def plan_kernels(*plans: dict) -> set[str]:
    return {l["kernel"] for p in plans for l in p["launches"]}


def run_plan(program: metal_emu.Program, p: dict, arrays: dict, seed: int = 0) -> dict:
    """Runs the plan's launches in order. arrays: role -> numpy array (or
    metal_emu.Window) for the caller's buffers (outputs updated in place), and
    optionally for scratch roles. Returns the scratch arrays."""
    scratch = {}
    for s in p["scratch"]:
        if s["role"] in arrays:
            scratch[s["role"]] = arrays[s["role"]]
            continue
        assert s["bytes"] % 4 == 0
        scratch[s["role"]] = np.full(s["bytes"] // 4, np.nan, np.float32)
    dispatches = []
    for launch in p["launches"]:
        buffers = {}
        for index, role in launch["buffers"]:
            buffers[index] = scratch[role] if role in scratch else arrays[role]
        buffers[launch["params_index"]] = params_bytes(launch["params"])
        tgm = {0: launch["threadgroup_bytes"]} if launch["threadgroup_bytes"] else {}
        dispatches.append(metal_emu.Dispatch(
            launch["kernel"], buffers, threadgroups=tuple(launch["grid"]),
            threads=tuple(launch["threads"]), threadgroup_memory=tgm))
    program.run(*dispatches, seed=seed)
    return scratch


# --- Values -----------------------------------------------------------------

def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """float values rounded to `dtype`, in STORAGE form (bfloat16: round to
    nearest even on the top 16 bits of float32)."""
    x = np.ascontiguousarray(x, np.float32)
    if dtype == "f32":
        return x.copy()
    if dtype == "f16":
        return x.astype(np.float16)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def to_f64(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)
