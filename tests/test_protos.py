import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_up_to_date():
    proc = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_client_app_does_not_import_torch():
    """The ClientApp is spawned per message: importing torch there would cost seconds every round."""
    code = "import sys, client.app; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_server_and_client_never_import_each_other():
    for package, other in (("server", "client"), ("client", "server")):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert f"from {other}" not in text and f"import {other}" not in text, f"{path} imports {other}"
