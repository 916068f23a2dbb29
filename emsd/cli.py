"""``emsd --config FILE``: parse arguments, load the config, run the daemon.

Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 2 for a bad command
line, config or start-up condition (one line on stderr naming the key and the
rule, never a traceback), 1 for an unexpected crash.
"""

from __future__ import annotations

import argparse
import os
import sys

from emsd import __version__, logs
from emsd.config import ConfigError, load_config
from emsd.faults import Faults


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="emsd", description="emsd: a KV-cache memory pool daemon")
    p.add_argument("--config", required=True, metavar="FILE", help="TOML config file")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   help="override log.level from the config")
    p.add_argument("--log-format", choices=["text", "json"], help="override log.format from the config")
    p.add_argument("--version", action="version", version=f"emsd {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config)
        Faults.parse(os.environ.get("EMSD_FAULTS", ""))  # tests only; a bad spec is a start-up error
    except (ConfigError, ValueError) as exc:
        print(f"emsd: config error: {exc}", file=sys.stderr)
        return 2
    logs.setup(args.log_level or config.log.level, args.log_format or config.log.format)
    from emsd.server import Daemon, StartupError

    try:
        import uvloop

        uvloop.run(_run(Daemon, config))
    except StartupError as exc:
        print(f"emsd: cannot start: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


async def _run(daemon_cls: type, config: object) -> None:
    await daemon_cls(config).run()


if __name__ == "__main__":
    sys.exit(main())
