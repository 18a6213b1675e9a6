"""scripts/bench_llm_decode.py: its variant syntax and its help (the measuring itself needs the full model)."""

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_llm_decode.py"


def test_variants_parse():
    mod = runpy.run_path(str(SCRIPT))
    name, v = mod["parse_variant"]("passive")
    assert name == "passive" and v["env.OMP_WAIT_POLICY"] == "PASSIVE" and v["type"] == "Q8_0"
    name, v = mod["parse_variant"]("mine:type=Q4_0,threads=1,env.GOMP_SPINCOUNT=0")
    assert name == "mine" and (v["type"], v["threads"], v["env.GOMP_SPINCOUNT"]) == ("Q4_0", "1", "0")
    with pytest.raises(SystemExit):
        mod["parse_variant"]("x:nonsense=1")
    with pytest.raises(SystemExit):
        mod["parse_variant"]("no-such-preset")


@pytest.mark.parametrize("arg", ["--help", "--list"])
def test_help_and_list_run(arg):
    r = subprocess.run([sys.executable, str(SCRIPT), arg], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and ("default" in r.stdout)
