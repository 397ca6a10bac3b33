"""v4engine installs as a wheel into a fresh venv, and the three parts import from it."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_built_wheel_imports_in_a_fresh_venv(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(tmp_path / "whl")],
                   check=True, timeout=300)
    (wheel,) = (tmp_path / "whl").glob("v4engine-*.whl")
    venv.create(tmp_path / "env", with_pip=True)
    python = tmp_path / "env" / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=300)
    # The dependencies (torch, onnx, ...) come from this environment, appended after the fresh one's own
    # site-packages, so v4engine itself can only come from the wheel.
    fresh_site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     check=True, capture_output=True, text=True).stdout.strip())
    (fresh_site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = ("import v4engine.builder, v4engine.plugins, v4engine.runtime, sys; "
             "from v4engine.runtime import Generator, GenerationResult, SamplingParams, V4Config; "
             "from v4engine.runtime.sessions import stored_weights; "
             "print(v4engine.runtime.__file__, stored_weights.SOURCE.is_file())")
    out = subprocess.run([python, "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert str(tmp_path / "env") in out.stdout
    assert out.stdout.split()[-1] == "True"           # the CPU kernels' source, compiled on first use


def test_editable_install_points_at_the_repository():
    import v4engine.runtime

    assert Path(v4engine.runtime.__file__).resolve().parent == ROOT / "runtime"


def test_the_runtime_never_imports_torch():
    probe = ("import sys, v4engine.runtime, v4engine.runtime.generator, v4engine.runtime.cli, "
             "v4engine.runtime.sessions.onnxruntime; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False"
