import pytest

from agentserving.operator.settings import OperatorSettings


@pytest.fixture
def settings() -> OperatorSettings:
    return OperatorSettings()
