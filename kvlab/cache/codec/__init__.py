"""How K/V bytes are encoded: the codecs (float casts, fp8, int8/int4/int2/int1 with group scales), the stores
that hold encoded slabs and attend over them, and KIVI's own layout (``QuantizedKVCache``)."""
