//go:build amd64 && !purego

package blake3

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

//go:generate go run gen_amd64.go

// wide: the CPU has AVX-512 (F: 32-bit lanes, gathers, rotates) and the OS saves its registers.
var wide = cpu.X86.HasAVX512F

//go:noescape
func compress16(in *byte, stride, blocks int, cv *[8]uint32, ctrLo, ctrHi, flags *[16]uint32, out *[8][16]uint32)

// compressLanes compresses 16 inputs of blocks blocks each, lane j's at in[j·stride:], from cv,
// lane j's counter ctr (+ j when perLane), block k's flags flags[k], into out[j].
func compressLanes(in []byte, stride, blocks int, cv *[8]uint32, ctr uint64, perLane bool, flags *[16]uint32, out [][8]uint32) {
	if len(in) < 15*stride+blocks*blockLen || len(out) < lanes {
		panic("blake3: short lanes")
	}
	var lo, hi [16]uint32
	for j := range lanes {
		c := ctr
		if perLane {
			c += uint64(j)
		}
		lo[j], hi[j] = uint32(c), uint32(c>>32)
	}
	var t [8][16]uint32
	compress16(unsafe.SliceData(in), stride, blocks, cv, &lo, &hi, flags, &t)
	for j := range lanes {
		for i := range 8 {
			out[j][i] = t[i][j]
		}
	}
}
