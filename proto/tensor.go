package proto

import (
	"encoding/binary"
	"fmt"
	"math"
)

// AppendFloat32s appends x to dst as little-endian float32s: a Tensor's Data for an F32 tensor.
func AppendFloat32s(dst []byte, x []float32) []byte {
	for _, v := range x {
		dst = binary.LittleEndian.AppendUint32(dst, math.Float32bits(v))
	}
	return dst
}

// Float32s decodes a little-endian float32 payload into a new slice.
func Float32s(b []byte) ([]float32, error) {
	if len(b)%4 != 0 {
		return nil, fmt.Errorf("decode float32s: %w: %d bytes is not a multiple of 4", ErrPayloadLength, len(b))
	}
	x := make([]float32, len(b)/4)
	for i := range x {
		x[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return x, nil
}

// AppendInt32s appends x to dst as little-endian int32s: a Tensor's Data for an I32 tensor.
func AppendInt32s(dst []byte, x []int32) []byte {
	for _, v := range x {
		dst = binary.LittleEndian.AppendUint32(dst, uint32(v))
	}
	return dst
}

// Int32s decodes a little-endian int32 payload into a new slice.
func Int32s(b []byte) ([]int32, error) {
	if len(b)%4 != 0 {
		return nil, fmt.Errorf("decode int32s: %w: %d bytes is not a multiple of 4", ErrPayloadLength, len(b))
	}
	x := make([]int32, len(b)/4)
	for i := range x {
		x[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return x, nil
}
