"""emsd side by side with Mooncake Store, LMCache, Redis and memcached: see __main__.py."""
