"""Write docs/settings.md from the settings' own definitions in app/ops/settings.py.

    python scripts/settings_doc.py            # rewrite docs/settings.md
    python scripts/settings_doc.py --check    # exit 1 if docs/settings.md is stale

Never edited by hand: each setting's description, default and allowed values live in its one definition.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.ops.settings import settings_markdown  # noqa: E402

PAGE = REPO / "docs" / "settings.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the page differs from the code")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write or check (default: %(default)s)")
    args = parser.parse_args()
    if not args.check:
        args.page.write_text(settings_markdown())
    elif args.page.read_text() != settings_markdown():
        print(f"{args.page} is stale: run python scripts/settings_doc.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
