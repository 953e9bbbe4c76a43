"""One stream for results (issue 15, item 2): the result a person asked for goes to stdout; notes, warnings,
progress, summaries of commands that write data and every ``wrote ...`` line go to stderr."""
import json
import os

from conftest import SAMPLES

NOTEBOOK = os.path.join(SAMPLES, "notebook.h5")
PER_CHANNEL = os.path.join(SAMPLES, "per_channel.h5")


def test_compare_semantics_report_on_stdout_wrote_on_stderr(cli, tmp_path):
    r = cli("compare-semantics", NOTEBOOK, "--num-bits", "2", "-o", tmp_path / "c.h5")
    assert r.exit_code == 0, r.output
    assert "TensorFlow vs PyTorch on 1,000 elements" in r.stdout
    assert "gradient masks differ at 87 elements" in r.stdout
    assert "wrote" not in r.stdout
    assert f"to {tmp_path / 'c.h5'}" in r.stderr and r.stderr.startswith("wrote outputs_tf")
    assert "TensorFlow vs PyTorch" not in r.stderr
    # --quiet drops the note, never the result
    r = cli("compare-semantics", NOTEBOOK, "--num-bits", "2", "-o", tmp_path / "c.h5", "--force", "-q")
    assert r.exit_code == 0 and "TensorFlow vs PyTorch" in r.stdout and r.stderr == ""


def test_compare_semantics_with_data_on_stdout_reports_on_stderr(cli):
    r = cli("compare-semantics", NOTEBOOK, "--num-bits", "2", "-o", "-")
    assert r.exit_code == 0, r.stderr
    assert r.stdout_bytes[:2] == b"PK"  # the npz, nothing else
    assert "TensorFlow vs PyTorch" in r.stderr


def test_nudge_table_on_stdout_warnings_and_wrote_on_stderr(cli, tmp_path):
    r = cli("nudge", "--min", "-1,-2,0.5", "--max", "1,2,3", "-o", tmp_path / "grid.h5")
    assert r.exit_code == 0, r.output
    assert "TensorFlow grid num_bits=8" in r.stdout and "ch 2" in r.stdout
    assert "warning" not in r.stdout and "wrote" not in r.stdout
    assert "warning: channel 2: [0.5, 3] does not contain 0" in r.stderr
    assert f"wrote scale, inv_scale, zero_point, zero_point_from_min, nudged_min, nudged_max to " \
           f"{tmp_path / 'grid.h5'}" in r.stderr
    assert "TensorFlow grid" not in r.stderr
    r = cli("nudge", "--variant", "quantize-and-dequantize-v4", "--min", "0.5", "--max", "2.5", "-o",
            tmp_path / "q.h5")
    assert r.exit_code == 0, r.output
    assert "QuantizeAndDequantizeV4 grid" in r.stdout and "wrote" not in r.stdout
    assert "wrote" in r.stderr and "grid num_bits" not in r.stderr


def test_nudge_no_warnings_is_a_note(cli):
    r = cli("nudge", "--min", "-1", "--max", "2", "--num-bits", "2")
    assert r.exit_code == 0, r.output
    assert "no warnings" in r.stderr and "no warnings" not in r.stdout
    assert "TensorFlow grid num_bits=2: integers [0, 3], 4 levels" in r.stdout


def test_fakequant_grad_says_it_wrote_the_figure(cli, tmp_path):
    fig = tmp_path / "ste.png"
    r = cli("fakequant-grad", NOTEBOOK, "-o", tmp_path / "g.h5", "--plot", fig)
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    assert f"wrote the figure to {fig}" in r.stderr and fig.exists()
    r = cli("fakequant-grad", NOTEBOOK, "-o", tmp_path / "g.h5", "--plot", fig, "--force", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["figure"] == str(fig)


def test_data_commands_keep_stdout_for_the_result(cli, tmp_path):
    for args in (["fakequant", NOTEBOOK, "-o", tmp_path / "f.h5"],
                 ["fakequant-grad", PER_CHANNEL, "-o", tmp_path / "g.h5"],
                 ["plot", "ste", NOTEBOOK, "-o", tmp_path / "s.png"]):
        r = cli(*args)
        assert r.exit_code == 0, (args, r.output)
        assert r.stdout == "", (args, r.stdout)
        assert "wrote" in r.stderr, (args, r.stderr)


def test_report_commands_print_the_result_on_stdout(cli):
    for args in (["report", PER_CHANNEL, "--top", "2"], ["inspect", PER_CHANNEL],
                 ["compare-semantics", PER_CHANNEL], ["nudge", PER_CHANNEL]):
        r = cli(*args)
        assert r.exit_code == 0, (args, r.output)
        assert r.stdout.strip(), args
        assert "wrote" not in r.stdout + r.stderr, args
        for doc in (cli(*args, "--json").stdout,):
            json.loads(doc)
