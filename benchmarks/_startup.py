"""Family 16 (``startup``): loading a saved Hugging Face model, ``ft.nn.from_hf(directory)``
against ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` on the same files.

Each load runs in a fresh process whose imports are done first (functree and JAX with the
backend up; torch, transformers and the model class), so a row is the time a user waits for
the model after ``import``: reading config.json, opening and checking the weights, building
the model and putting its parameters on the device. The two loads alternate round by round
(fresh processes, order rotating); the ratio is the median of the per-round ratios. The
functree load is split (its phases timed by wrapping ``functree.hf._load``'s steps, and JAX's
own events: tracing, lowering, compiles and their count), with the imports' seconds and
whether ``transformers`` or ``torch`` was imported by the load.

Sizes (Llama, safetensors written by ``save_pretrained``): tiny (vocab 128, d 32, 2 layers,
float32), small (vocab 8000, d 256, 4 layers, bfloat16: the 2.66 s vs 1.97 s of issue 47),
medium (vocab 32000, d 512, 8 layers, bfloat16; not with ``--quick``). Target: functree ≤ 2×
``from_pretrained`` at every size.

A second pair of rows per size builds the same model from its config alone, initialized to
train from scratch: ``ft.nn.from_hf(config, key=...)`` (one compiled program) against
``AutoModelForCausalLM.from_config(config)`` (torch's eager initializers).

Run alone: ``python benchmarks/run.py --only startup``. ``python benchmarks/_startup.py
probe ft|hf DIRECTORY`` is the fresh-process probe the family starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

SIZES = {
    "tiny": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, dtype="float32"),
    "small": dict(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, dtype="bfloat16"),
    "medium": dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=8, dtype="bfloat16"),
}
FUNCTREE, HF = "ft.nn.from_hf(directory)", "transformers from_pretrained"
FUNCTREE_INIT, HF_INIT = "ft.nn.from_hf(config, key=key)", "transformers from_config"


def write(directory: str, size: dict[str, Any]) -> None:
    """A Llama of ``size`` saved by ``save_pretrained`` (random weights, the file's dtype)."""
    import torch
    import transformers

    options = {k: v for k, v in size.items() if k != "dtype"}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**options)).to(getattr(torch, size["dtype"]))
    model.save_pretrained(directory)


def _timed_steps(events: dict[str, float]) -> None:
    """Wrap ``functree.hf._load``'s and ``_torch``'s steps so each adds its seconds to ``events``."""
    from functree.hf import _load as _hf
    from functree.interop import _torch

    def wrap(module: Any, name: str, label: str) -> None:
        inner = getattr(module, name, None)
        if inner is None:  # a step renamed since: left out of the split
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                events[label] = events.get(label, 0.0) + time.perf_counter() - start

        setattr(module, name, timed)

    wrap(_hf, "read_config", "config.json")
    wrap(_hf, "read_weights", "open + check the weights' files")
    wrap(_hf, "_template", "the abstract template")
    wrap(_hf, "load_torch_state_dict", "load_torch_state_dict (all)")
    wrap(_torch, "_plan", "  plan (names, layouts)")
    wrap(_torch, "_converted", "  convert to ft's layouts")
    wrap(_torch, "_stored", "  read the files + copy to the device")
    wrap(_torch, "copy_all", "    the host copies (files -> the parameters' layouts)")


def probe(which: str, directory: str) -> dict[str, Any]:
    """One load in this (fresh) process, its imports done first and timed apart."""
    start = time.perf_counter()
    if which in ("ft", "ft-config"):
        import jax
        import jax.numpy as jnp

        import functree as ft

        jax.block_until_ready(jnp.zeros(()) + 1)  # the backend up, as after any first use of JAX
        steps: dict[str, float] = {}
        _timed_steps(steps)
        counts: dict[str, list[float]] = {}
        jax.monitoring.register_event_duration_secs_listener(
            lambda name, secs, **_: counts.setdefault(name.rsplit("/", 1)[-1], []).append(secs))
        imported = sys.modules.keys() & {"transformers", "torch"}
        with open(os.path.join(directory, "config.json")) as f:
            config = json.load(f)
        dtype = jnp.bfloat16 if config.get("dtype") == "bfloat16" else jnp.float32
        source, key = (config, jax.random.key(0)) if which == "ft-config" else (directory, None)
        imports = time.perf_counter() - start
        start = time.perf_counter()
        model = jax.block_until_ready(ft.nn.from_hf(source, dtype=dtype, key=key))
        seconds = time.perf_counter() - start
        parameters = sum(x.size for x in jax.tree.leaves(model))

        def total(suffix: str) -> tuple[int, float]:
            found = [v for k, vs in counts.items() if k.endswith(suffix) for v in vs]
            return len(found), round(sum(found), 4)

        compiles, compile_s = total("backend_compile_duration")
        split = {k: round(v, 4) for k, v in steps.items()}
        split.update(trace_s=total("jaxpr_trace_duration")[1], lower_s=total("jaxpr_to_mlir_module_duration")[1],
                     compiles=compiles, compile_s=compile_s,
                     imported_by_the_load=sorted((sys.modules.keys() & {"transformers", "torch"}) - imported))
    else:
        import torch
        import transformers
        import transformers.modeling_utils  # imported lazily by from_pretrained: done first
        from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401 - the model's module too

        transformers.logging.set_verbosity_error()
        imports = time.perf_counter() - start
        start = time.perf_counter()
        if which == "hf-config":
            config = transformers.AutoConfig.from_pretrained(directory)
            model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
        seconds = time.perf_counter() - start
        parameters = sum(p.numel() for p in model.parameters())
        split = {"dtype": str(next(model.parameters()).dtype), "threads": torch.get_num_threads()}
    return {"which": which, "seconds": round(seconds, 4), "imports_s": round(imports, 3), "parameters": parameters,
            "split": split}


def _probe(which: str, directory: str) -> dict[str, Any]:
    here = os.path.abspath(__file__)
    out = subprocess.run([sys.executable, here, "probe", which, directory], capture_output=True, text=True,
                         check=True, env={**os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def startup(quick: bool = False) -> Any:
    from _harness import Table, interleave, paired_rows

    table = Table("startup", "16. Loading a saved Llama: ft.nn.from_hf(directory) vs transformers from_pretrained "
                  "(fresh processes, imports done)", "ms", "≤ 2× from_pretrained at every size")
    sizes = ["tiny", "small"] if quick else list(SIZES)
    rounds = 3 if quick else 7
    with tempfile.TemporaryDirectory() as root:
        for name in sizes:
            directory = os.path.join(root, name)
            write(directory, SIZES[name])
            results: dict[str, list[dict[str, Any]]] = {"ft": [], "hf": []}

            def block(which: str, directory: str = directory, results: Any = results) -> Any:
                def run() -> float:
                    results[which].append(_probe(which, directory))
                    return results[which][-1]["seconds"]
                return run

            values = interleave({FUNCTREE: block("ft"), HF: block("hf")}, rounds)
            inits: dict[str, list[dict[str, Any]]] = {"ft-config": [], "hf-config": []}
            init_values = interleave({FUNCTREE_INIT: block("ft-config", results=inits),
                                      HF_INIT: block("hf-config", results=inits)}, rounds)
            megabytes = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)) / 1e6
            rows = paired_rows(values, HF, scale=1e3)
            for row in rows:
                row.name = f"{name} ({megabytes:.1f} MB): {row.name}"
            rows[0].ok = rows[0].ratio is not None and rows[0].ratio <= 2.0
            table.rows += rows
            init_rows = paired_rows(init_values, HF_INIT, scale=1e3)
            for row in init_rows:
                row.name = f"{name}: {row.name}"
            init_rows[0].ok = init_rows[0].ratio is not None and init_rows[0].ratio <= 2.0
            table.rows += init_rows
            table.checks[f"{name}: from config, functree split (last round, s)"] = inits["ft-config"][-1]["split"]
            last = results["ft"][-1]
            table.checks[f"{name}: functree split (last round, s)"] = last["split"]
            table.checks[f"{name}: imports s (functree, transformers)"] = (
                results["ft"][-1]["imports_s"], results["hf"][-1]["imports_s"])
            table.checks[f"{name}: parameters equal"] = last["parameters"] == results["hf"][-1]["parameters"]
    table.notes.append("each value is one load in a fresh process after its imports; the split is functree's own "
                       "steps (wrapped) and JAX's events (tracing, lowering, compiles)")
    return [table]


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        print(json.dumps(probe(sys.argv[2], sys.argv[3])))
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        table = startup(quick="--quick" in sys.argv)[0]
        print(table.markdown())
        print(json.dumps(table.checks, indent=1))
