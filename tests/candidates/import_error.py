"""A candidate that fails to import."""

import shapewise_no_such_module  # noqa: F401
