// Package safetensors reads and writes the safetensors format (https://huggingface.co/docs/safetensors):
// an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte
// range, and the raw little-endian data. Shoal's checkpoints and the PyTorch anchor both speak it.
//
// Only F32 tensors are read and written: Shoal trains in float32. Reads check every offset, shape
// and length against the file before allocating, so a truncated or hostile file is an error, never
// a panic or a huge allocation. Standard library only.
package safetensors
