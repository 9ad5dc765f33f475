"""The GCS emulator the tests run (``python tests/gcs_server.py --port=P --bucket=B``).

gcp-storage-emulator, with two gaps closed where it differs from GCS in what TensorStore relies
on (Orbax checkpoints and the parameter server's persistence on gs://):
* real GCS sends an object's generation in the ``x-goog-generation`` header of a media download,
  and TensorStore takes a read's generation from it for conditional writes (an OCDBT manifest is
  updated only if its generation still matches). The emulator omits it: TensorStore saw an empty
  generation and refused the update ("Malformed StorageGeneration");
* real GCS lists only names in [startOffset, endOffset), TensorStore's delete_range lists that
  way, and the emulator ignored both: deleting one persisted version deleted its neighbours.

Its HTTP server takes one connection at a time with the standard library's listen backlog of 5:
a client with more ranged reads in flight (gcsfs cat_ranges) had its extra connections' SYNs
dropped and retried after 1 s each. The backlog is raised (GCS itself takes them all at once).

It also counts the bytes of object data it serves (media downloads, ranged or not) per value of
the request header ``X-Rlax-Reader`` (a test sets it per process through gcsfs's session
headers, e.g. ``FSSPEC_GS='{"session_kwargs": {"headers": {"X-Rlax-Reader": "p0"}}}'``);
``GET /_rlax/bytes_served`` answers them as JSON {reader: bytes} ("" for requests without it).
"""

from __future__ import annotations

import argparse
import http.server
import threading

from gcp_storage_emulator.handlers import objects

_download = objects.download
_served: dict[str, int] = {}  # X-Rlax-Reader -> object bytes served
_served_lock = threading.Lock()


def _download_with_generation(request, response, storage, *args, **kwargs):  # noqa: ANN001, ANN202
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])
    except Exception:  # noqa: BLE001, S110 - missing objects: the handler answers 404 itself
        pass
    write_file = response.write_file

    def counted(content, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        key = request.get_header("x-rlax-reader", "") or ""
        with _served_lock:
            _served[key] = _served.get(key, 0) + len(content)
        return write_file(content, *a, **kw)

    response.write_file = counted
    return _download(request, response, storage, *args, **kwargs)


def _bytes_served(request, response, storage):  # noqa: ANN001, ANN202, ARG001
    with _served_lock:
        response.json(dict(_served))


_ls = objects.ls


def _ls_with_offsets(request, response, storage, *args, **kwargs):  # noqa: ANN001, ANN202
    start = (request.query.get("startOffset") or [None])[0]
    end = (request.query.get("endOffset") or [None])[0]
    send = response.json

    def in_range(payload):  # noqa: ANN001, ANN202
        if isinstance(payload, dict) and "items" in payload:
            payload = dict(
                payload,
                items=[
                    o
                    for o in payload["items"]
                    if (start is None or o["name"] >= start) and (end is None or o["name"] < end)
                ],
            )
        return send(payload)

    response.json = in_range
    return _ls(request, response, storage, *args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    args = parser.parse_args()
    # Before the server module builds its routes from these names.
    objects.download = _download_with_generation
    objects.ls = _ls_with_offsets
    http.server.HTTPServer.request_queue_size = 128  # the emulator's server (see above)
    from gcp_storage_emulator import server as emulator
    from gcp_storage_emulator.server import create_server

    # Read on every request (Router.handle), so a route added here is served.
    emulator.HANDLERS = ((r"^/_rlax/bytes_served$", {"GET": _bytes_served}), *emulator.HANDLERS)

    server = create_server("127.0.0.1", args.port, in_memory=True, default_bucket=args.bucket)
    server.run()


if __name__ == "__main__":
    main()
