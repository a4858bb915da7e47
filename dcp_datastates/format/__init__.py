"""The checkpoint format, stated once: file names and layout, the safetensors header, the
metadata codec, the checksum grid and its verification, the restricted decoding of stored
values. No I/O here: the storage layer moves the bytes."""
