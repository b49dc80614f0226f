"""What each process of tests/test_loading.py's shared model cache runs, in a module of its own: a spawned process
imports the module its function is in, and this one imports neither torch nor the engine (the test module's
imports cost each process seconds of CPU)."""
import os
import time


def fetch_and_hash(uri, opts, cache, first, asking, copied, results):
    """One process of several sharing a model cache (every actor of a node, every pod on one volume). The first
    one starts its copy once all have asked for the model (``asking``); a copy of another's own begins only once
    the first one's is written (``copied``), as a slower process's would."""
    import hashlib

    import s3fs
    os.environ["EAGLE_RAY_CACHE"] = cache
    from eagle_ray.model.loading import download_s3
    get = s3fs.S3FileSystem.get

    def watched_get(self, *args, **kwargs):
        if first:
            asking.wait(300)
            time.sleep(0.5)   # the others are past their look at the cache by now
            try:
                return get(self, *args, **kwargs)
            finally:
                copied.set()
        copied.wait(300)
        return get(self, *args, **kwargs)
    s3fs.S3FileSystem.get = watched_get
    if not first:
        asking.wait(300)
    local = download_s3(uri, opts)
    results.put({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(local.iterdir())
                 if not f.name.startswith(".")})
