package proto

import (
	"encoding/binary"
	"fmt"
	"math"
	"unsafe"
)

// hostLittleEndian: the host lays a number out in memory as the wire does (amd64, arm64, wasm
// — every platform Shoal ships for), so a slice's memory is its payload and one copy moves it,
// where the loops below take a few nanoseconds a value (3% of a pipeline worker's CPU on the
// default job's float32 boundaries, encoding and decoding). The loops stay for big-endian hosts.
var hostLittleEndian = func() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}()

// bytesOf is the memory of x, n bytes a value, for the little-endian copies.
func bytesOf[T float32 | int32 | uint16](x []T) []byte {
	if len(x) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), len(x)*int(unsafe.Sizeof(x[0])))
}

// Float32Bytes is x as a little-endian float32 payload: x's own memory on a little-endian host
// (no copy, so it is valid while x does not change; hashing a shard's state every step and
// uploading evidence read it so), an encoding in *buf otherwise.
func Float32Bytes(x []float32, buf *[]byte) []byte {
	if len(x) == 0 {
		return nil
	}
	if hostLittleEndian {
		return bytesOf(x)
	}
	*buf = AppendFloat32s((*buf)[:0], x)
	return *buf
}

// AppendFloat32s appends x to dst as little-endian float32s: a Tensor's Data for an F32 tensor.
func AppendFloat32s(dst []byte, x []float32) []byte {
	if hostLittleEndian {
		return append(dst, bytesOf(x)...)
	}
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
	if hostLittleEndian {
		copy(bytesOf(x), b)
		return x, nil
	}
	for i := range x {
		x[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return x, nil
}

// AppendInt32s appends x to dst as little-endian int32s: a Tensor's Data for an I32 tensor.
func AppendInt32s(dst []byte, x []int32) []byte {
	if hostLittleEndian {
		return append(dst, bytesOf(x)...)
	}
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
	if hostLittleEndian {
		copy(bytesOf(x), b)
		return x, nil
	}
	for i := range x {
		x[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return x, nil
}

// AppendBF16s appends x to dst as little-endian bfloat16s (the top 16 bits of float32s): a
// Tensor's Data for a BF16 tensor.
func AppendBF16s(dst []byte, x []uint16) []byte {
	if hostLittleEndian {
		return append(dst, bytesOf(x)...)
	}
	for _, v := range x {
		dst = binary.LittleEndian.AppendUint16(dst, v)
	}
	return dst
}

// BF16s decodes a little-endian bfloat16 payload into a new slice of bit patterns.
func BF16s(b []byte) ([]uint16, error) {
	if len(b)%2 != 0 {
		return nil, fmt.Errorf("decode bfloat16s: %w: %d bytes is not a multiple of 2", ErrPayloadLength, len(b))
	}
	x := make([]uint16, len(b)/2)
	if hostLittleEndian {
		copy(bytesOf(x), b)
		return x, nil
	}
	for i := range x {
		x[i] = binary.LittleEndian.Uint16(b[2*i:])
	}
	return x, nil
}

// AppendI8Rows appends the payload of an I8 tensor of len(scale) rows of len(q)/len(scale)
// codes to dst: the scales, then the codes (see I8).
func AppendI8Rows(dst []byte, scale []float32, q []int8) []byte {
	dst = AppendFloat32s(dst, scale)
	for _, v := range q {
		dst = append(dst, byte(v))
	}
	return dst
}

// I8Rows decodes the payload of an I8 tensor of rows×cols into new slices of its scales (rows)
// and codes (rows·cols), checking its length and every rule of I8: finite, non-negative scales,
// codes in [-127, 127], only zero codes in a row of scale 0.
func I8Rows(b []byte, rows, cols int) (scale []float32, q []int8, err error) {
	// As Shape.Bytes counts: nothing at all when either dimension is 0. Both are bounded by
	// len(b) before they are multiplied.
	want := 0
	if rows > 0 && cols > 0 && rows <= len(b) && cols <= len(b) {
		want = rows * (4 + cols)
	}
	if rows < 0 || cols < 0 || len(b) != want || want == 0 && rows > 0 && cols > 0 {
		return nil, nil, fmt.Errorf("decode i8 rows: %w: %d bytes for %d rows of %d", ErrPayloadLength, len(b), rows, cols)
	}
	if want == 0 {
		return nil, nil, nil
	}
	if err := checkI8(b, 0, 4*rows); err != nil {
		return nil, nil, fmt.Errorf("decode i8 rows: %w", err)
	}
	if err := checkZeroRows(b, rows, cols); err != nil {
		return nil, nil, fmt.Errorf("decode i8 rows: %w", err)
	}
	scale, err = Float32s(b[:4*rows])
	if err != nil {
		return nil, nil, err
	}
	q = make([]int8, rows*cols)
	for i, v := range b[4*rows:] {
		q[i] = int8(v)
	}
	return scale, q, nil
}

// AppendI4Rows appends the payload of an I4 tensor to dst: scales (the rows' groups' bfloat16
// bits, row by row), then codes (each row's ⌈cols/2⌉ bytes) — kernels.QuantizeInt4's two
// outputs, which are the layout (see I4).
func AppendI4Rows(dst []byte, scales []uint16, codes []byte) []byte {
	dst = AppendBF16s(dst, scales)
	return append(dst, codes...)
}

// I4Rows decodes the payload of an I4 tensor of rows×cols into new slices of its scales (bfloat16
// bits, rows·⌈cols/I4Group⌉) and codes (rows·⌈cols/2⌉ bytes), checking its length and every rule
// of I4: finite, non-negative scales, codes in [-7, 7], only zero codes in a group of scale 0, an
// odd row's padding nibble 0.
func I4Rows(b []byte, rows, cols int) (scales []uint16, codes []byte, err error) {
	if rows < 0 || cols < 0 {
		return nil, nil, fmt.Errorf("decode i4 rows: %w: %d rows of %d", ErrPayloadLength, rows, cols)
	}
	want, err := Shape{uint32(rows), uint32(cols), 1, 1}.Bytes(I4, len(b))
	if uint64(rows) > math.MaxUint32 || uint64(cols) > math.MaxUint32 || err != nil || len(b) != want {
		return nil, nil, fmt.Errorf("decode i4 rows: %w: %d bytes for %d rows of %d", ErrPayloadLength, len(b), rows, cols)
	}
	if want == 0 {
		return nil, nil, nil
	}
	if err := checkI4(b, 0, rows, cols); err != nil {
		return nil, nil, fmt.Errorf("decode i4 rows: %w", err)
	}
	if err := checkZeroGroups(b, rows, cols); err != nil {
		return nil, nil, fmt.Errorf("decode i4 rows: %w", err)
	}
	scaleBytes, _, _ := i4Layout(rows, cols)
	if scales, err = BF16s(b[:scaleBytes]); err != nil {
		return nil, nil, err
	}
	return scales, append([]byte(nil), b[scaleBytes:]...), nil
}
