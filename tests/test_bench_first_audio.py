"""scripts/bench_first_audio.py end to end on the tiny fixture model: it runs and its JSON lines
load (the GPU check script keeps them; a value JSON cannot hold once lost a run's rows)."""

import json
import runpy
from pathlib import Path

from helpers import MODEL_DIR

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_first_audio.py"


def test_runs_on_the_tiny_model_and_writes_json_lines(tmp_path, capsys):
    out = tmp_path / "first-audio.jsonl"
    main = runpy.run_path(str(SCRIPT))["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--llm", "torch", "--threads", "1", "--prompt-cache-mb", "0,512",
                 "--warm", "--requests", "1", "--prompt-seconds", "1", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_cache_mb"] for r in rows] == [0, 512]
    for r in rows:
        assert r["llm"] == "torch" and r["warm"] is True and r["flow"] in ("fp32", "bf16", "int8")
        assert len(r["first_audio_s"]) == 1 and r["first_audio_s"][0] > 0
    assert "first audio" in capsys.readouterr().out
