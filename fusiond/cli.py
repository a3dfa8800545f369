"""The ``fusiond`` command: parse flags, layer the config, run the daemon on the chosen loop.

Exit codes: 0 clean stop (or a valid config with --check-config), 1 a service failed,
78 (EX_CONFIG) the configuration is invalid, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import fusiond
from fusiond.config import DEFAULT_CONFIG_PATH, add_flags, describe, load_config
from fusiond.errors import ConfigError

EX_OK = 0
EX_FAILED = 1
EX_CONFIG = 78

log = logging.getLogger("fusiond")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fusiond",
        usage="fusiond [--config PATH] [--check-config] [--<key> VALUE ...]",
        description="fusion peer daemon: discovers peers, measures links, elects a scheduler "
        "and trains. Configuration layers: defaults < config file < FUSION_* environment < "
        "flags.",
        epilog="exit codes: 0 stopped cleanly (or --check-config: valid), 1 a service failed, "
        "78 invalid configuration, 130 interrupted. Talk to a running daemon with fusionctl.",
    )
    p.add_argument("--config", metavar="PATH", default=None,
                   help=f"config file (default {DEFAULT_CONFIG_PATH} if it exists) "
                   "[env FUSION_CONFIG]")
    p.add_argument("--check-config", action="store_true", default=None,
                   help="validate the configuration, print every value and where it came "
                   "from, and exit (0 valid, 78 invalid) [env FUSION_CHECK_CONFIG]")
    p.add_argument("--version", action="version", version=f"fusiond {fusiond.__version__}")
    add_flags(p)
    return p


def loop_factory(name: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """The event loop to run on: uvloop where available for "auto"; raises ConfigError when
    uvloop is asked for explicitly and missing."""
    if name in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if name == "uvloop":
                raise ConfigError("loop = 'uvloop' but uvloop is not installed; "
                                  "install it or set loop = 'asyncio'") from None
            return "asyncio", None
        return "uvloop", uvloop.new_event_loop
    return "asyncio", None


T = TypeVar("T")


def run_on_loop(coro: Coroutine[Any, Any, T], loop: str = "auto") -> T:
    """Run `coro` to completion on the event loop the daemon would use (`loop_factory`): the
    harnesses and benchmarks measure what a daemon runs."""
    _, factory = loop_factory(loop)
    kwargs: dict[str, Any] = {"loop_factory": factory} if factory else {}
    with asyncio.Runner(**kwargs) as runner:
        return runner.run(coro)


def run(argv: Sequence[str]) -> int:
    """Entry point: returns the exit code."""
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    check = bool(ns.check_config) or os.environ.get("FUSION_CHECK_CONFIG", "").lower() in (
        "1", "true", "yes", "on")
    try:
        loaded = load_config(path=ns.config, flags=ns)
        loop_name, factory = loop_factory(loaded.config.loop)
    except ConfigError as e:
        print(f"fusiond: invalid configuration: {e}", file=sys.stderr)
        return EX_CONFIG
    if check:
        print(describe(loaded))
        for w in loaded.warnings:
            print(f"warning: {w}", file=sys.stderr)
        print("configuration is valid", file=sys.stderr)
        return EX_OK

    from fusiond.daemon import Daemon, configure_logging

    configure_logging(loaded.config.log_level, loaded.config.log_format)
    for w in loaded.warnings:
        log.warning("%s", w)
    log.info("fusiond %s starting on the %s event loop (config: %s)", fusiond.__version__,
             loop_name, loaded.file or "defaults")
    from fusiond.profile.threads import apply_cpu_allowance

    threads = apply_cpu_allowance()  # before the profile is measured: it reports these threads
    log.info("torch compute threads: %d (torch's default %d; %s)", threads.threads,
             threads.default, threads.why)
    daemon = Daemon(loaded, flags=ns, config_path=ns.config, owns_process=True)
    kwargs: dict[str, Any] = {"loop_factory": factory} if factory else {}
    try:
        with asyncio.Runner(**kwargs) as runner:
            return runner.run(daemon.run())
    except KeyboardInterrupt:
        return 130
