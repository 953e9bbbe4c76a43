"""qgcli.monitor.torch under torch.distributed: DDP on the CPU with gloo, 2 processes, one history written by
rank 0 with the ranks' statistics combined (skipped where 2 gloo processes cannot start)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

_SCRIPT = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    import torch.ao.quantization as tq
    from qgcli.monitor.torch import monitor

    def run(rank, folder):
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
        torch.manual_seed(0)
        model = torch.nn.Sequential(tq.QuantStub(), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        model.qconfig = tq.get_default_qat_qconfig("x86")
        tq.prepare_qat(model.train(), inplace=True)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        with monitor(ddp, f"{folder}/history", every=2, optimizer=opt):
            for _ in range(5):
                x = torch.randn(4, 8, generator=g) * (1 + rank)
                opt.zero_grad()
                ddp(x).square().mean().backward()
                opt.step()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(run, args=(sys.argv[1],), nprocs=2)
        print("ok")
""")


@pytest.mark.slow  # three processes importing torch: ~50 s on 2 busy cores
@pytest.mark.skipif(os.environ.get("QGCLI_LONG", "") in ("", "0"), reason="3 processes, ~50 s: set QGCLI_LONG=1")
def test_ddp_two_processes_one_history(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                              env=env, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip("2 gloo processes did not finish in 180 s")
    if proc.returncode != 0 and "ok" not in proc.stdout:
        if any(w in proc.stderr for w in ("gloo", "Gloo", "rendezvous", "Address", "connect")):
            pytest.skip(f"gloo could not start: {proc.stderr.strip().splitlines()[-1]}")
        raise AssertionError(proc.stderr[-3000:])
    from qgcli.monitor.history import read_history

    h = read_history(tmp_path / "history")
    assert h.steps == [1, 2, 4] and h.meta["world_size"] == "2"
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(tmp_path / "history")) as db:
        assert {r[0] for r in db.execute("select ranks from samples")} == {2}
    assert [layer["path"] for layer in h.layers] == ["0.activation_post_process", "1.weight_fake_quant",
                                                     "1.activation_post_process", "3.weight_fake_quant",
                                                     "3.activation_post_process"]
    # the two ranks' inputs differ (rank 1's are twice as large): the combined share is their mean, a NaN
    # count their sum; the weights are the same on both ranks (DDP)
    s = h.series("1.weight_fake_quant")
    assert all(v > 0 for v in s["dy_norm"]) and s["nan_inputs"] == [0, 0, 0]
    assert [f for f in os.listdir(tmp_path) if f.startswith("history")] == ["history"]  # one file, closed
