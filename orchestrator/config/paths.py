"""Where this checkout is: the paths every layer may need, defined at the bottom so none imports upward."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = PROJECT_ROOT / "conf"
