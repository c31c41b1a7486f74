import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
if str(KERNELS) not in sys.path:
    sys.path.insert(0, str(KERNELS))
