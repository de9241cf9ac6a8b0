"""The Ray worker setup hook's log filter: Ray Train's first resource-request timeout of a process (the autoscaling
coordinator actor still starting) is dropped; later ones and other errors still reach the log."""

from __future__ import annotations

import logging

import pytest
from ray.exceptions import GetTimeoutError

from tasks.ray_train import COORDINATOR_LOGGER, FirstCoordinatorTimeout, quiet_coordinator_start_up

pytestmark = pytest.mark.integration  # Ray's own exception type (unit tests import no Ray: test_layout.py)


def _record(message: str, error: BaseException | None) -> logging.LogRecord:
    exc_info = (type(error), error, None) if error is not None else None
    return logging.LogRecord(COORDINATOR_LOGGER, logging.WARNING, __file__, 1, message, None, exc_info)


def test_only_the_first_timeout_is_dropped():
    timeout = "Failed to send resource request for train-1. If this only happens transiently ..."
    quiet = FirstCoordinatorTimeout()
    assert quiet.filter(_record("Requesting resources: {'CPU': 2} * 1", None))
    assert quiet.filter(_record(timeout, RuntimeError("actor died")))  # not a timeout: logged
    assert not quiet.filter(_record(timeout, GetTimeoutError("Get timed out: some object(s) not ready.")))
    assert quiet.filter(_record(timeout, GetTimeoutError("Get timed out: some object(s) not ready.")))


def test_the_hook_installs_one_filter_on_the_coordinator_logger(caplog):
    logger = logging.getLogger(COORDINATOR_LOGGER)
    before = list(logger.filters)
    try:
        quiet_coordinator_start_up()
        quiet_coordinator_start_up()
        assert sum(isinstance(f, FirstCoordinatorTimeout) for f in logger.filters) == 1
        with caplog.at_level(logging.WARNING, logger=COORDINATOR_LOGGER):
            for _ in range(2):
                try:
                    raise GetTimeoutError("Get timed out")
                except GetTimeoutError:
                    logger.warning("Failed to send resource request for train-2.", exc_info=True)
        assert len([r for r in caplog.records if r.name == COORDINATOR_LOGGER]) == 1
    finally:
        logger.filters[:] = before
