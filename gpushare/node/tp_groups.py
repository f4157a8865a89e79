"""Which engine workers run a tensor-parallel model: one group of N devices per model.

A tensor-parallel model (`models[].tensor_parallel` N) splits every layer over N engine
workers of this node, which all-reduce activations after each split layer; the slowest link
in the group sets the pace. So the N devices chosen are those whose worst pairwise link is
best (gpu_links.link_rank: NVLink first, then one PCIe switch, then one NUMA node); ties go to
the set with the fewest devices already in another model's group, then to engine.devices
order. One exception to "link first": a set of free devices wins over a better-linked set that
shares devices with another group, as long as it does not cross sockets (two models sharing
two GPUs while two others idle would each run at half speed; PXB instead of PIX costs less). Devices of different kinds (a GPU, a MIG instance, a CPU) never form a group; with
several kinds, GPUs are tried first, then MIG instances, then CPUs.

`tensor_parallel: auto` is the smallest N whose devices each hold need_bytes / N (weights +
KV, split evenly over the ranks) within their worker's memory_total_bytes. CPU workers have
no fixed memory size, so auto means one device there unless the model names its devices
(`tensor_parallel_devices`, which fixes the group and its rank order). With need_bytes unknown
(`gpushare node plan`, which does not read model files) auto is one device too, and says so.

A group whose worst link is SYS (or unknown) is refused unless the model sets
`tensor_parallel_cross_numa: true`. Refusals are ValueErrors naming the model.

How the daemon calls it, after plan_workers:

    links = GpuLinks() if all(w.torch_device == "cpu" for w in plan.workers) else read_gpu_links(runner)
    groups = plan_tp_groups(settings.models, plan, links, need_bytes={name: weights + kv, ...})
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from gpushare.node.devices import WorkerPlan, WorkerPlanSet
from gpushare.node.gpu_links import (SELF, GpuLinks, describe_link, is_cross_socket, link_rank, worker_kind,
                                     worker_link)

KINDS = ("gpu", "mig", "cpu")  # tried in this order
_KIND_WORDS = {"gpu": "GPUs", "mig": "MIG instances", "cpu": "CPU workers"}
# C(56 MIG instances, 4) is ~370,000 sets: past this many, the model must name its devices.
MAX_CANDIDATE_SETS = 50_000


@dataclass
class TPGroupPlan:
    model: str
    workers: list[WorkerPlan]  # rank order
    link: str  # the worst pairwise link: "NV18", "PXB", "NUMA-local", "SYS"; "X" for one device
    why: str  # one sentence: why these devices


def plan_tp_groups(models, plan: WorkerPlanSet, links: GpuLinks, need_bytes: dict[str, int] | None = None,
                   refusals: list[str] | None = None) -> list[TPGroupPlan]:
    """A group for each of `models` (config ModelEntry) with tensor_parallel != 1, in config order;
    earlier groups steer later ones away from their devices. need_bytes: model name -> weights +
    KV, for auto and the fit check. With `refusals` given, a refused model's message is appended
    there and the others are still planned; without it the first refusal raises."""
    need_bytes = need_bytes or {}
    used: dict[str, int] = {}
    groups = []
    for index, model in enumerate(models):
        if model.tensor_parallel == 1 and not model.tensor_parallel_devices:
            continue
        key = f"models[{index}]"
        try:
            if model.tensor_parallel_devices:
                workers = _named_workers(plan, model.tensor_parallel_devices, f"{key} {model.name}")
                group = plan_tp_group(model.name, len(workers), workers, links, model.tensor_parallel_cross_numa,
                                      need_bytes.get(model.name), used=used, key=key, fixed=True)
            else:
                group = plan_tp_group(model.name, model.tensor_parallel, plan.workers, links,
                                      model.tensor_parallel_cross_numa, need_bytes.get(model.name), used=used, key=key)
        except ValueError as exc:
            if refusals is None:
                raise
            refusals.append(str(exc))
            continue
        for worker in group.workers:
            used[worker.name] = used.get(worker.name, 0) + 1
        groups.append(group)
    return groups


def plan_tp_group(model: str, size: int | str, workers: list[WorkerPlan], links: GpuLinks, cross_numa: bool,
                  need_bytes: int | None = None, *, used: dict[str, int] | None = None, key: str | None = None,
                  fixed: bool = False) -> TPGroupPlan:
    """The group for one model: `size` devices (an int, or "auto") among `workers`. used: worker
    name -> groups it is already in. key: "models[i]", for messages. fixed: `workers` are the group
    itself, in rank order (tensor_parallel_devices)."""
    label = f"{key} {model}" if key else model
    used = used or {}
    names = ", ".join(w.name for w in workers)
    if size != "auto" and size > len(workers):
        where = "tensor_parallel_devices names" if fixed else "engine.devices has"
        raise ValueError(f"{label}: tensor_parallel {size} needs {size} devices, {where} {len(workers)} ({names})")
    if size == "auto":
        kind, pool = next(((k, p) for k in KINDS if (p := _of_kind(workers, k))), ("gpu", []))
        size, fitting, note = _auto_size(label, kind, pool, need_bytes)
    else:
        kind, pool = next(((k, p) for k in KINDS if len(p := _of_kind(workers, k)) >= size), (None, []))
        if kind is None:
            counts = ", ".join(f"{len(p)} {_KIND_WORDS[k]}" for k in KINDS if (p := _of_kind(workers, k)))
            raise ValueError(f"{label}: tensor_parallel {size} needs {size} devices of one kind (a GPU, a MIG "
                             f"instance and a CPU never form a group); the devices are {counts} ({names})")
        fitting, note = _fitting(label, kind, pool, size, need_bytes), ""
    chosen, link, best_link = _best_set(label, fitting, size, links, used, fixed)
    if size > 1 and is_cross_socket(link) and not cross_numa:
        option = f"{key}.tensor_parallel_cross_numa" if key else "models[].tensor_parallel_cross_numa"
        raise ValueError(
            f"{label}: the best-linked {size} {_KIND_WORDS[kind]} ({', '.join(w.name for w in chosen)}) are joined "
            f"only by {describe_link(link)}: all-reduces over the inter-socket link run several times slower than "
            f"over NVLink or a PCIe switch, after every split layer; set {option}: true to accept")
    return TPGroupPlan(model, chosen, link, _why(chosen, link, best_link, kind, used, fixed, note))


def _named_workers(plan: WorkerPlanSet, devices: list[str], label: str) -> list[WorkerPlan]:
    try:
        return [plan.find(text) for text in devices]
    except ValueError as exc:
        raise ValueError(f"{label}: tensor_parallel_devices: {exc}") from None


def _of_kind(workers: list[WorkerPlan], kind: str) -> list[WorkerPlan]:
    return [w for w in workers if worker_kind(w) == kind]


def _auto_size(label: str, kind: str, pool: list[WorkerPlan], need_bytes: int | None):
    """-> (N, the devices that can hold a 1/N share, a clause for `why`)."""
    if not pool:
        raise ValueError(f"{label}: tensor_parallel auto: there is no engine worker")
    if kind == "cpu":
        return 1, pool, ("auto: CPU workers have no fixed memory size, so one device "
                         "(name tensor_parallel_devices for a CPU group)")
    if need_bytes is None:
        return 1, pool, "auto: the model's size is not known here; the daemon sizes the group when it loads it"
    for size in range(1, len(pool) + 1):
        share = math.ceil(need_bytes / size)
        fitting = [w for w in pool if (w.memory_total_bytes or 0) >= share]
        if len(fitting) >= size:
            return size, fitting, (f"auto: {size} rank(s) of {_gib(share)} each fit in "
                                   f"{_gib(min(w.memory_total_bytes for w in fitting))}")
    largest = max(w.memory_total_bytes or 0 for w in pool)
    raise ValueError(f"{label}: tensor_parallel auto: {_gib(need_bytes)} (weights + KV) does not fit split over all "
                     f"{len(pool)} {_KIND_WORDS[kind]} ({_gib(math.ceil(need_bytes / len(pool)))} each; the largest "
                     f"holds {_gib(largest)})")


def _fitting(label: str, kind: str, pool: list[WorkerPlan], size: int, need_bytes: int | None) -> list[WorkerPlan]:
    """The devices that can hold one rank's share; all of them when the size is unknown or on the CPU."""
    if need_bytes is None or kind == "cpu":
        return pool
    share = math.ceil(need_bytes / size)
    fitting = [w for w in pool if (w.memory_total_bytes or 0) >= share]
    if len(fitting) < size:
        raise ValueError(f"{label}: tensor_parallel {size}: each rank holds {_gib(share)} (weights + KV split "
                         f"{size} ways), and only {len(fitting)} of the {_KIND_WORDS[kind]} hold that much")
    return fitting


def _best_set(label: str, pool: list[WorkerPlan], size: int, links: GpuLinks, used: dict[str, int],
              fixed: bool) -> tuple[list[WorkerPlan], str, str]:
    """The `size` devices of `pool`: not across sockets, then fewest already used, then the best
    worst link, then pool order. -> (devices, their worst link, the best worst link of any set)"""
    if fixed:
        return pool, _worst_link(pool, links), _worst_link(pool, links)
    if math.comb(len(pool), size) > MAX_CANDIDATE_SETS:
        raise ValueError(f"{label}: tensor_parallel {size} over {len(pool)} devices is too many sets to compare "
                         f"({math.comb(len(pool), size)}); name the devices in tensor_parallel_devices")
    best, best_score, best_link = None, None, None
    for combo in itertools.combinations(range(len(pool)), size):
        group = [pool[i] for i in combo]
        link = _worst_link(group, links)
        score = (is_cross_socket(link), sum(1 for w in group if used.get(w.name)), -link_rank(link), combo)
        if best_score is None or score < best_score:
            best, best_score = (group, link), score
        if best_link is None or link_rank(link) > link_rank(best_link):
            best_link = link
    return *best, best_link


def _worst_link(group: list[WorkerPlan], links: GpuLinks) -> str:
    pairs = [worker_link(a, b, links) for a, b in itertools.combinations(group, 2)]
    # Among equally ranked links, "SYS" is named rather than "unknown": it is the one that was measured.
    return min(pairs, key=lambda link: (link_rank(link), link != "SYS")) if pairs else SELF


def _why(group: list[WorkerPlan], link: str, best_link: str, kind: str, used: dict[str, int], fixed: bool,
         note: str) -> str:
    names = ", ".join(w.name for w in group)
    if len(group) == 1:
        return f"{names}: one device holds the model ({note or 'tensor_parallel 1'})."
    joined = f"every pair joined by at least {describe_link(link)}"
    shared = [w.name for w in group if used.get(w.name)]
    if fixed:
        clauses = [f"{names}: as listed in tensor_parallel_devices", joined]
    elif link_rank(best_link) > link_rank(link):  # only when this set is free and the better ones are not
        clauses = [f"{names}: {len(group)} {_KIND_WORDS[kind]} in no other tensor-parallel group, {joined}",
                   f"the sets linked by {best_link} share devices with other groups"]
    else:
        clauses = [f"{names}: the best-linked {len(group)} {_KIND_WORDS[kind]} of this node, {joined}",
                   f"{', '.join(shared)} also serve(s) another tensor-parallel group (no better-linked free set)"
                   if shared else "none is in another tensor-parallel group"]
    return "; ".join(clauses + ([note] if note else [])) + "."


def _gib(size_bytes: int) -> str:
    return f"{size_bytes / 2**30:.1f} GiB"
