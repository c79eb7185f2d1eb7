"""The run report (launch/report.py, comppo_jax.eval.run_report) read in a real browser: headless
Chromium loads the page from disk and the tests read the rendered DOM; and a trained run's kept
responses, W&B offline log and page end to end (slow)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    CPU_ONLY_ENV,
    full_disk,
    launch_quick,
    launch_script,
    small_train_config,
    small_train_flags,
    stand_in_batch,
)

from comppo_jax.credit import fit_position_schedule, save_position_schedule
from comppo_jax.data.tokenizers import CharTokenizer
from comppo_jax.eval.run_report import (
    ADVANTAGE_COLORMAP,
    KAPPA_COLORMAP,
    color_of,
    color_table,
    run_report_html,
    write_run_report,
)
from comppo_jax.models import model_config
from comppo_jax.runs.samples import save_samples
from comppo_jax.train.recorder import GATE_PROFILE_FILE
from comppo_jax.train.samples import kept_responses
from comppo_jax.train.schema import save_run_config
from comppo_jax.train.specs import resolve

PHASES = ["stable", "stable", "warning", "warning", "stable", "stable"]
HOSTILE_PROMPT = "What is 1 + 1? </script><script>document.title = 'broken'</script>"
OUTCOME_ROW = {  # a critic that knows nothing of the outcome: early credit at chance
    "credit/outcome_explained_variance": -0.02,
    "credit/outcome_spearman": 0.04,
    "credit/early_sign_agreement": 0.55,
    "credit/trace_horizon": 1.5,
}


def report(run_dir, *extra):
    """launch/report.py on `run_dir`, forked from the quick launch process (tests/launches.py): it never starts
    JAX's backend."""
    return launch_quick("launch/report.py", f"--run={run_dir}", *extra)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A CompPO run's directory as the recorder leaves it: config, six steps of metrics with a
    phase change, a gate profile and responses kept at steps 3 and 6."""
    path = tmp_path_factory.mktemp("run")
    cfg = small_train_config(path)
    save_run_config(cfg, str(path))
    with open(path / "metrics.jsonl", "w") as f:
        for step, phase in enumerate(PHASES, 1):
            row = {"step": step, "phase": phase, "reward/mean": 0.1 * step, "gate/mean": 0.5, **OUTCOME_ROW}
            if step == 1:  # a run older than the diagnostics, resumed: no field at its first step
                row = {k: v for k, v in row.items() if not k.startswith("credit/")}
            f.write(json.dumps(row) + "\n")
    spec = resolve(cfg, model_config(cfg.model)).recorder
    for step in (3, 6):
        sampled, scored = stand_in_batch(cfg, spec.credit.recipe, seed=step)
        record = kept_responses(spec, CharTokenizer(), step, sampled, scored)
        record["responses"][0]["prompt"] = HOSTILE_PROMPT  # text that must not end the page's script
        save_samples(str(path), record)
    kappa, mask = scored.rollout.kappa, sampled.host_mask
    save_position_schedule(fit_position_schedule(kappa, mask), str(path / GATE_PROFILE_FILE))
    return path


def rgba(hex_color: str) -> str:
    """A #rrggbb colour as the browser's computed style reads it."""
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r}, {g}, {b}, 1)"


def spans(browser, pane):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, f"#{pane}-tokens .tok")


def test_the_page_lists_the_kept_steps_colours_each_token_by_its_gate_and_toggles_to_advantages(
    run_dir, browser, tmp_path
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    result = report(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    page = run_dir / "report.html"
    assert result.stdout.strip() == str(page)
    assert "http://" not in page.read_text().replace("http://www.w3.org/2000/svg", "")  # nothing to fetch
    browser.get(page.as_uri())
    assert browser.get_log("browser") == []  # no script error
    picker = Select(browser.find_element(By.ID, "step-picker"))
    assert [option.text for option in picker.options] == ["3", "6"]
    assert [cell.get_attribute("data-phase") for cell in browser.find_elements(By.CSS_SELECTOR, "#phases .phase")] == (
        PHASES
    )
    assert "step 3: stable → warning" in browser.page_source.replace("&rarr;", "→")
    curves = browser.find_elements(By.CSS_SELECTOR, "#outcome-panel .outcome-curve")
    assert [c.get_attribute("data-metric") for c in curves] == list(OUTCOME_ROW)[:3]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#outcome-panel circle")) == 3 * 5  # none at step 1
    assert browser.find_element(By.ID, "outcome-reading").text == (
        "Over the last 5 steps the critic predicts none of the outcome (explained variance -0.02, Spearman 0.04); "
        "credit reaches the first half of a response with the outcome's sign 55% of the time; a final reward keeps "
        "1/e of itself over its response's last 1.5 tokens."
    )
    assert browser.find_element(By.ID, "response-meta").text.endswith(HOSTILE_PROMPT)  # shown as text
    assert "broken" not in browser.title

    picker.select_by_visible_text("6")
    Select(browser.find_element(By.ID, "response-picker")).select_by_index(1)
    record = json.loads((run_dir / "samples" / "step_000006.json").read_text())
    response = record["responses"][1]
    kappa = response["tokens"]["kappa"]
    shown = spans(browser, "primary")
    assert len(shown) == len(response["t"]) == response["length"] > 0
    assert [span.text for span in shown] == [piece or "∅" for piece in response["pieces"]]
    kappa_colors = color_table(KAPPA_COLORMAP)
    low, high = record["kappa_range"]
    for span, value in zip(shown, kappa):
        assert span.value_of_css_property("background-color") == rgba(color_of(kappa_colors, value, low, high))
    assert len({span.value_of_css_property("background-color") for span in shown}) > 1
    title = shown[0].get_attribute("title")
    assert "t=1 " in title and "H_t=" in title and "c_t=" in title and "kappa_t=" in title and "V_t=" in title
    browser.save_screenshot(str(tmp_path / "report_kappa.png"))

    browser.find_element(By.ID, "color-toggle").click()
    assert browser.find_element(By.ID, "color-toggle").get_attribute("data-color") == "advantage"
    advantages, standard = np.asarray(response["tokens"]["comp_gae"]), np.asarray(response["tokens"]["gae"])
    scale = max(np.abs(advantages).max(), np.abs(standard).max())
    advantage_colors = color_table(ADVANTAGE_COLORMAP)
    for pane, values in (("primary", advantages), ("compared", standard)):
        shown = spans(browser, pane)
        assert len(shown) == len(values)
        for span, value in zip(shown, values):
            assert span.value_of_css_property("background-color") == rgba(
                color_of(advantage_colors, value, -scale, scale)
            )
    assert "GAE" in browser.find_element(By.ID, "compared-title").text
    assert browser.find_elements(By.CSS_SELECTOR, "#advantage-plot polyline")
    screenshot = tmp_path / "report_advantage.png"
    browser.save_screenshot(str(screenshot))
    print(f"screenshots: {tmp_path}/report_kappa.png, {screenshot}")
    assert screenshot.stat().st_size > 10_000


def test_a_run_without_kept_responses_or_with_a_torn_metrics_line_says_so_and_a_directory_without_a_run_is_named(
    tmp_path, browser
):
    from selenium.webdriver.common.by import By

    save_run_config(small_train_config(tmp_path), str(tmp_path))
    rows = [{"step": 1, "phase": "stable", "reward/mean": 0.25}, {"step": 2, "phase": "stable", "reward/mean": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 3, "rew')
    page = run_report_html(str(tmp_path))  # a run killed mid-write: its rows that parse, and a note
    assert "No summary.json yet" in page and "No gate profile" in page and "stopped after step 2" in page
    assert "No step has logged its credit against the outcome" in page
    assert "1 line(s) of metrics.jsonl do not parse (left out)" in page and 'id="curves"' in page
    (tmp_path / "report.html").write_text(page)
    browser.get((tmp_path / "report.html").as_uri())
    assert "No kept responses" in browser.find_element(By.ID, "browser").text
    result = report(tmp_path / "nothing")
    assert result.returncode != 0 and "holds no training run" in result.stderr


# Text that would change the HTML parser's state inside the page's data script: "<!--<script>" makes
# the data's own "</script>" (and the page script's) no longer end it.
HOSTILE_TEXTS = ("<!--<script>", "</script>", "<img src=x onerror=\"document.title='broken'\">")


def kept_step(step: int, prompt: str = "What is 1 + 1?", pieces: tuple[str, ...] = ("2", ".")) -> dict:
    """A kept step's record (comppo_jax.runs.samples) written by hand: one CompPO response of `pieces`."""
    n = len(pieces)
    ramp = [round(0.1 * t, 5) for t in range(1, n + 1)]
    response = {
        "row": 0,
        "prompt": prompt,
        "response": "".join(pieces),
        "reward": 1.0,
        "verdict": "correct",
        "length": n,
        "t": list(range(1, n + 1)),
        "pieces": list(pieces),
        "tokens": {"kappa": [0.5] * n, "value": ramp, "comp_gae": ramp, "gae": ramp[::-1]},
    }
    return {
        "step": step,
        "method": "comppo",
        "gate": "attention",
        "estimator": "comp_gae",
        "lam": 1.0,
        "kappa_range": [0.2, 1.0],
        "responses": [response],
    }


def hand_written_run(path, *records):
    """A run directory written by hand: config, three steps of metrics, an up-to-date curves.png (so
    the page draws none) and `records` as its kept steps."""
    import matplotlib.image

    save_run_config(small_train_config(path), str(path))
    rows = [{"step": step, "phase": "stable", "reward/mean": 0.25} for step in (1, 2, 3)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    matplotlib.image.imsave(path / "curves.png", np.zeros((2, 2, 3)))
    for record in records:
        save_samples(str(path), record)
    return path


def test_a_conversations_environment_spans_are_marked_and_the_credit_crosses_them(tmp_path, browser):
    """A tool run's kept response (rollout.environment): its environment tokens are drawn dashed grey with no
    credit, and the policy's tokens on both sides of a reply keep theirs, as the learner assigns it."""
    from selenium.webdriver.common.by import By

    cfg = small_train_config(tmp_path, rollout__environment="calculator")
    save_run_config(cfg, str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "phase": "stable"}) + "\n")
    spec = resolve(cfg, model_config(cfg.model)).recorder
    sampled, scored = stand_in_batch(cfg, spec.credit.recipe, lengths=(10, 10, 10, 10), seed=1)
    env_mask = np.zeros(sampled.host_mask.shape, bool)
    env_mask[:, 4:7] = True  # a reply after a call at t=4
    sampled = sampled._replace(env_mask=env_mask)
    record = kept_responses(spec, CharTokenizer(), 1, sampled, scored)
    save_samples(str(tmp_path), record)
    response = record["responses"][0]
    assert response["replies"] == 1 and response["tokens"]["env"] == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    credit = np.asarray(response["tokens"]["comp_gae"])
    assert (credit[4:7] == 0).all() and (credit[[3, 7, 9]] != 0).all()
    assert report(tmp_path).returncode == 0
    browser.get((tmp_path / "report.html").as_uri())
    assert browser.get_log("browser") == []
    shown = spans(browser, "primary")
    marked = [i for i, span in enumerate(shown) if "env" in span.get_attribute("class").split()]
    assert marked == [4, 5, 6]
    assert shown[4].value_of_css_property("background-color") == rgba("#e8e8e8")
    assert "environment token" in shown[4].get_attribute("title")
    assert "1 environment replies" in browser.find_element(By.ID, "response-meta").text


def test_prompts_and_responses_holding_markup_show_as_text_and_leave_the_browser_working(tmp_path, browser):
    from selenium.webdriver.common.by import By

    prompt = " ".join(HOSTILE_TEXTS)
    run = hand_written_run(tmp_path, kept_step(1, prompt, HOSTILE_TEXTS))
    browser.get(Path(write_run_report(str(run))).as_uri())
    assert browser.get_log("browser") == []  # no script error
    assert browser.find_element(By.ID, "response-meta").text.endswith(prompt)
    assert [span.text for span in spans(browser, "primary")] == list(HOSTILE_TEXTS)
    assert len(browser.find_elements(By.TAG_NAME, "img")) == 1  # the curves: no <img> made of the text
    assert "broken" not in browser.title


def test_kept_step_files_the_page_cannot_read_are_left_out_and_named(tmp_path, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    no_responses = {key: value for key, value in kept_step(1).items() if key != "responses"}
    mistyped = kept_step(2)
    mistyped["responses"][0]["t"] = "1 2"
    run = hand_written_run(tmp_path, no_responses, mistyped, kept_step(3))
    browser.get(Path(write_run_report(str(run))).as_uri())
    assert browser.get_log("browser") == []  # no script error
    assert [o.text for o in Select(browser.find_element(By.ID, "step-picker")).options] == ["3"]
    text = browser.find_element(By.TAG_NAME, "body").text
    assert "step_000001.json: no `responses`" in text
    assert "step_000002.json: `responses[0].t`" in text


def test_a_torn_summary_or_gate_profile_is_left_out_and_named_and_the_rest_is_built(tmp_path, browser):
    from selenium.webdriver.common.by import By

    run = hand_written_run(tmp_path, kept_step(3))
    (run / "summary.json").write_text('{"steps": 3, "final_dev')  # both killed mid-write
    (run / GATE_PROFILE_FILE).write_text('{"format": ')
    result = report(run)
    assert result.returncode == 0, result.stderr[-3000:]
    (warning,) = [line for line in result.stderr.splitlines() if "left out" in line]
    assert str(run / "summary.json") in warning and str(run / GATE_PROFILE_FILE) in warning
    browser.get((run / "report.html").as_uri())
    assert browser.get_log("browser") == []
    text = browser.find_element(By.TAG_NAME, "body").text
    assert f"{run / 'summary.json'}: not valid JSON" in text and f"{run / GATE_PROFILE_FILE}: not a JSON file" in text
    assert browser.find_element(By.ID, "curves") and spans(browser, "primary")


def test_the_summary_explains_its_warm_up_steps_and_shows_floats_to_four_digits(tmp_path):
    run = hand_written_run(tmp_path)
    summary = {"steps": 4, "actor_updates": 2, "mean_gate": 0.6180339887498949, "skipped_updates": 0}
    (run / "summary.json").write_text(json.dumps(summary))
    page = run_report_html(str(run))
    assert "<th>steps</th><td>4 <small>(includes the critic&#x27;s 2 warm-up steps)</small></td>" in page
    assert "<th>mean_gate</th><td>0.618</td>" in page and "<th>skipped_updates</th><td>0</td>" in page
    # The config's steps (2) are the actor updates: the warm-up came on top of them.
    assert "<th>steps</th><td>2 <small>(actor updates; the critic&#x27;s 2 warm-up steps" in page


def test_a_report_on_a_full_disk_fails_in_one_line_naming_where_and_leaves_no_temporary_or_partial_page(tmp_path):
    run = hand_written_run(tmp_path, kept_step(3))
    with full_disk(4096):  # the page is larger: its write fails part way (a new process inherits the limit)
        result = launch_script("launch/report.py", f"--run={run}")
    assert result.returncode != 0
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert str(run / "report.html") in error and "--out" in error
    assert not (run / "report.html").exists() and not list(run.rglob("*.tmp"))
    (run / "curves.png").unlink()  # a run still going: its curves are drawn in a scratch folder first
    with full_disk(4096), pytest.raises(OSError, match="could not be drawn in the scratch folder"):
        write_run_report(str(run))


def wandb_records(path):
    """The records of a W&B run file (`run-<id>.wandb`: a ":W&B" header, then LevelDB-log
    blocks of 32 KiB holding wandb_internal_pb2.Record messages, maybe split across blocks)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # a block's zero-filled tail
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or a split record's last part
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.slow
def test_a_trained_run_keeps_responses_at_each_evaluation_logs_them_to_wandb_offline_and_reports_them(
    tmp_path, browser
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    run = tmp_path / "run"
    result = launch_script(
        "launch/train.py",
        *small_train_flags(run, loggers="jsonl,tensorboard,wandb"),
        env=dict(CPU_ONLY_ENV, WANDB_MODE="offline", WANDB_SILENT="true"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [row["step"] for row in rows if "dev_accuracy" in row]
    assert evaluated == [2, 3]  # the critic warm-up step is not evaluated
    kept = sorted(os.listdir(run / "samples"))
    assert kept == ["step_000002.json", "step_000003.json"]  # outputs.sample_every=0: with each evaluation
    record = json.loads((run / "samples" / kept[-1]).read_text())
    assert len(record["responses"]) == 4 and record["estimator"] == "comp_gae"
    assert {"kappa", "H", "c", "value", "comp_gae", "gae"} <= set(record["responses"][0]["tokens"])

    # W&B, offline: the scalars against `step` and one table per kept step, in the run directory.
    run_id = (run / "wandb_run_id").read_text().strip()
    (offline,) = (run / "wandb").glob(f"offline-run-*-{run_id}")
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in wandb_records(offline / f"run-{run_id}.wandb")
        if r.WhichOneof("record_type") == "history"
    ]
    logged = {h["step"]: h["reward/mean"] for h in history if "reward/mean" in h}
    assert logged == pytest.approx({row["step"]: row["reward/mean"] for row in rows})
    assert sorted(h["step"] for h in history if "samples/_type" in h) == [2, 3]
    tables = sorted((offline / "files" / "media" / "table").glob("samples_*.table.json"))
    assert len(tables) == 2
    table = json.loads(tables[-1].read_text())
    assert table["columns"][:4] == ["step", "row", "prompt", "response"] and len(table["data"]) == 4
    assert {row[3] for row in table["data"]} == {response["response"] for response in record["responses"]}

    result = report(run)
    assert result.returncode == 0, result.stderr[-3000:]
    browser.get((run / "report.html").as_uri())
    assert [o.text for o in Select(browser.find_element(By.ID, "step-picker")).options] == ["2", "3"]
    Select(browser.find_element(By.ID, "step-picker")).select_by_visible_text("3")
    assert len(spans(browser, "primary")) == len(record["responses"][0]["t"])
    assert "finished" in browser.find_element(By.TAG_NAME, "body").text
    browser.save_screenshot(str(tmp_path / "trained_run_report.png"))
