"""shared/errors.py says which HTTP status each domain error becomes; shared.http.handlers.error_response
is where that happens. They must agree (the docstring of ObjectStoreError said 500 while
error_response sent 502)."""

from __future__ import annotations

import inspect
import re

from shared import errors
from shared.http.handlers import error_response


def _example(cls: type[errors.DS3Error]) -> errors.DS3Error:
    params = list(inspect.signature(cls.__init__).parameters)[1:]
    samples = {"message": "m", "earliest_offset": "0_0", "final_offset": "0_0", "current_epoch": 1,
               "expected": 1, "received": 2, "key": "k", "retry_after": 1, "error": None,
               "owner_id": "i-1", "advertise_url": "http://i-1:4437", "epoch": 3, "lease_expires_at": 1.5e9,
               "owner_url": "http://i-2:4437", "generation": 2, "me": "i-3", "current_generation": 4}
    return cls(*(samples[p] for p in params))


def test_each_error_class_names_the_status_it_is_sent_as() -> None:
    checked = []
    for name, cls in vars(errors).items():
        if not (isinstance(cls, type) and issubclass(cls, errors.DS3Error)) or cls is errors.DS3Error:
            continue
        named = re.search(r"\((\d{3})\b", cls.__doc__ or "")
        if named is None:
            continue  # (e.g. ObjectNotFound: the 404 in its docstring is S3's, it is an ObjectStoreError)
        assert error_response(_example(cls)).status == int(named.group(1)), name
        checked.append(name)
    assert "ObjectStoreError" in checked and len(checked) >= 15, checked


def test_the_module_names_the_function_that_maps_errors() -> None:
    assert errors.__doc__ is not None and "error_response" in errors.__doc__
