"""The GCS emulator the tests run (``python tests/gcs_server.py --port=P --bucket=B``).

gcp-storage-emulator, with two gaps closed where it differs from GCS in what TensorStore relies
on (Orbax checkpoints and the parameter server's persistence on gs://):
* real GCS sends an object's generation in the ``x-goog-generation`` header of a media download,
  and TensorStore takes a read's generation from it for conditional writes (an OCDBT manifest is
  updated only if its generation still matches). The emulator omits it: TensorStore saw an empty
  generation and refused the update ("Malformed StorageGeneration");
* real GCS lists only names in [startOffset, endOffset), TensorStore's delete_range lists that
  way, and the emulator ignored both: deleting one persisted version deleted its neighbours.
"""

from __future__ import annotations

import argparse

from gcp_storage_emulator.handlers import objects

_download = objects.download


def _download_with_generation(request, response, storage, *args, **kwargs):  # noqa: ANN001, ANN202
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])
    except Exception:  # noqa: BLE001, S110 - missing objects: the handler answers 404 itself
        pass
    return _download(request, response, storage, *args, **kwargs)


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
    from gcp_storage_emulator.server import create_server

    server = create_server("127.0.0.1", args.port, in_memory=True, default_bucket=args.bucket)
    server.run()


if __name__ == "__main__":
    main()
