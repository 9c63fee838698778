"""Locations with storage options, as the native layer takes them."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Tuple, Union

from .. import _native

#: ``object_store`` configuration keys and values for object-store locations (``s3://``,
#: ``gs://``, ``az://``), applied over the environment and credential files: the
#: ``storage_options`` of polars and deltalake (``{"aws_endpoint": "http://…",
#: "aws_allow_http": "true"}``, ``{"google_service_account": "/path/key.json"}``,
#: ``{"azure_storage_account_key": "…"}``, ``{"azure_storage_connection_string": "…"}``).
#: Local paths ignore them.
StorageOptions = Optional[Mapping[str, Any]]


def native_location(location: Any, storage_options: StorageOptions = None) -> Union[str, _native.Location]:
    """``location`` as the native functions take it: a path or URL as a string, or with storage
    options a :class:`tessera.Location` carrying them (``storage_options`` over a given
    ``Location``'s own). Values become strings (``True`` is ``"True"``, which the stores read
    as true)."""
    where, options = split_location(location, storage_options)
    if not options:
        return where
    return _native.Location(where, {str(k): v for k, v in options.items()})


def split_location(location: Any, storage_options: StorageOptions = None) -> Tuple[str, StorageOptions]:
    """``(url, storage_options)`` of ``location`` (a path, URL or :class:`tessera.Location`),
    ``storage_options`` over a ``Location``'s own: for code that builds sub-locations."""
    if isinstance(location, _native.Location):
        return location.url, {**location.storage_options, **(storage_options or {})}
    return os.fspath(location), storage_options


def local_dir(location: Any) -> Optional[str]:
    """The local directory of ``location`` (a path, ``file://…``, or a :class:`tessera.Location`),
    None for other locations (object stores, ``mem://``): the core's location parser decides."""
    if isinstance(location, _native.Location):
        return location.local_dir
    return _native.Location(os.fspath(location)).local_dir


def location_url(location: Any) -> str:
    """The path or URL of ``location`` (a string, a path, or a :class:`tessera.Location`)."""
    if isinstance(location, _native.Location):
        return location.url
    return os.fspath(location)
