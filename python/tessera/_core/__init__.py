"""The one private core under tessera's Python front ends (``tessera.torch``,
``tessera.olmo_core``, ``tessera.dist_checkpointing``).

Each front end keeps its peer's names and semantics and calls down into these modules and
``tessera._native``; none imports another front end. Layers, lowest first (no module imports
one above it, and nothing imports inside a function to dodge a circle):

- ``storage``: locations with storage options, as the native layer takes them;
- ``comm``: the communicator the native layer calls for its exchanges, and the one choice of it;
- ``dtypes``: torch / numpy dtypes and the format's element type names;
- ``paths``: walking nested state dicts, and a path's encoding for the core (integer keys);
- ``values``: plain values, ``torch.save`` fallbacks and object payload tags (taken from Rust);
- ``descriptors``: the typed values a tensor or object crosses into the core as;
- ``layout``: a tensor's or DTensor's local data, global shape, offset and replica;
- ``staging``: page-locked staging buffers and the async saver of a process;
- ``io``: one native save and one native load that own staging and the communicator choice.
"""
