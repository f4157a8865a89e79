"""`gpushare node ...`'s command line: topo, plan, apply, and mps start|stop|status|env.

`add_node_parser(subparsers)` adds the `node` command to gpushare's argparse tree; each leaf
sets `func`, which reads the config's node:, engine: and models: sections and runs the verb of
node/commands.py, returning its exit status.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from gpushare.node.commands import NodeContext, apply, mps, plan, topo
from gpushare.node.node_settings import parse_node_settings
from gpushare.settings.engine_settings import read_engine
from gpushare.settings.settings import read_tensor_parallel_models


def add_node_parser(subparsers) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--sysfs-root", default="/", help="read CPU and PCI topology under this root (default /)")
    common.add_argument("--config", default=os.environ.get("GPUSHARE_CONFIG"),
                        help="gpushare YAML config (default $GPUSHARE_CONFIG); its node: section is used")
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    node = subparsers.add_parser("node", help="prepare this node: CPU pinning, MIG, MPS")
    actions = node.add_subparsers(dest="node_command", required=True)
    for name, text in (("topo", "CPU cores (P/E/SMT), NUMA, GPUs with locality, MIG and MPS state"),
                       ("plan", "the engine workers the daemon would start, and what `apply` would run"),
                       ("apply", "apply MIG and MPS settings (needs root and node.manage: true)")):
        actions.add_parser(name, parents=[common], help=text).set_defaults(func=_handle)
    mps_parser = actions.add_parser("mps", parents=[common], help="MPS control daemons")
    mps_parser.add_argument("action", choices=["start", "stop", "status", "env"])
    mps_parser.add_argument("--gpu", help="env: only this GPU or MIG instance (uuid or GPU index)")
    mps_parser.set_defaults(func=_handle)
    return node


def _handle(args) -> int:
    try:
        raw = yaml.safe_load(Path(args.config).read_text()) if args.config else None
        raw = raw if isinstance(raw, dict) else {}
        settings = parse_node_settings(raw.get("node"))
        engine = read_engine(raw.get("engine"))
        models = read_tensor_parallel_models(raw.get("models"), engine)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"gpushare node: config {args.config}: {exc}", file=sys.stderr)
        return 2
    ctx = NodeContext(sysfs_root=args.sysfs_root, settings=settings, devices=engine.devices, device=engine.device,
                      models=models)
    if args.node_command == "mps":
        return mps(ctx, args.action, sys.stdout, gpu=args.gpu, as_json=args.json)
    return {"topo": topo, "plan": plan, "apply": apply}[args.node_command](ctx, sys.stdout, as_json=args.json)
