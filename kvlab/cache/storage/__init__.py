"""Where K/V sit: contiguous and static slabs, the MLA latent slab, paged blocks of a ``BlockPool`` with prefix
hashing, and a prefix slab shared by a batch."""
