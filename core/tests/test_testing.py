"""The test helpers' own behaviour that CI depends on to explain a failure."""

from __future__ import annotations

import sys

import pytest

from testkit.servers import free_port, service_process


def test_a_service_that_dies_on_start_puts_its_log_tail_in_the_error(tmp_path):
    script = "import sys; print('bind failed: port in use', flush=True); sys.exit(3)"
    url = f"http://127.0.0.1:{free_port()}/readyz"
    with pytest.raises(RuntimeError) as err, service_process(
            [sys.executable, "-c", script], url, log_path=tmp_path / "svc.log", timeout_s=30):
        pass
    assert "process exited with 3" in str(err.value)
    assert "bind failed: port in use" in str(err.value)
