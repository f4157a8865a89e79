"""LoRA adapters served as models of their own on a loaded base: attaching one loads only its
weights into the base's adapter table (models/lora_table.py); a request naming it runs on the base
with the adapter's slot. Runs on the engine thread (Engine.add_adapter / remove_adapter)."""

from gpushare.models.lora import LoraAdapter


def attach(engine, name: str, base: str, adapter: LoraAdapter) -> None:
    """ValueError (naming both) when the adapter does not fit the base; KeyError if the base is not loaded."""
    if name in engine.models or name in engine.encoders or name in engine.adapter_bases:
        raise ValueError(f"model {name!r} is already loaded")
    resident = engine.models.get(base)
    if resident is None:
        raise KeyError(f"base model {base!r} of adapter {name!r} is not loaded")
    if not hasattr(resident.loaded.model, "adapter_table"):
        raise ValueError(f"base model {base!r} does not take LoRA adapters")
    adapter.name = name
    resident.loaded.model.adapter_table(base).add(adapter)
    engine.adapter_bases[name] = base
    engine.flush()


def detach(engine, name: str) -> None:
    """Unload adapter ``name`` (its requests end with an error); the base stays."""
    base = engine.adapter_bases.pop(name, None)
    resident = engine.models.get(base) if base is not None else None
    if resident is None:
        return
    for seq in list(resident.scheduler.running) + list(resident.scheduler.waiting):
        if seq.adapter == name:
            engine.step_outputs.finish(resident, seq, "abort",
                                       error=f"the request was cancelled: adapter {name!r} was unloaded")
    resident.loaded.model.adapters.remove(name)
    engine.flush()


def forget_base(engine, base: str) -> None:
    """The base went: so did its adapters."""
    for name in [n for n, b in engine.adapter_bases.items() if b == base]:
        del engine.adapter_bases[name]


def resolve(engine, model_name: str) -> tuple[str, str | None]:
    """(the loaded model a request for ``model_name`` runs on, its adapter or None)."""
    base = engine.adapter_bases.get(model_name)
    return (model_name, None) if base is None else (base, model_name)


def adapter_bytes(engine) -> dict[str, tuple[str, int]]:
    """adapter name -> (its base, its weights' bytes)."""
    return {name: (base, engine.models[base].loaded.model.adapters.nbytes(name))
            for name, base in engine.adapter_bases.items() if base in engine.models}
