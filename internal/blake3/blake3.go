package blake3

import (
	"encoding/binary"
	"math/bits"
	"sync"
	"unsafe"

	zb "github.com/zeebo/blake3"
)

const (
	chunkLen   = 1024
	blockLen   = 64
	chunkStart = 1 << 0
	chunkEnd   = 1 << 1
	parent     = 1 << 2
	root       = 1 << 3
	lanes      = 16
)

var iv = [8]uint32{0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19}

// wideMin is the smallest input the wide path takes: below it the tree's scalar edges weigh more
// than the lanes gain.
const wideMin = 16 * chunkLen

// Sum256 is the BLAKE3 hash of b, 32 bytes.
func Sum256(b []byte) [32]byte {
	if !wide || len(b) < wideMin {
		return zb.Sum256(b)
	}
	return sumWide(b, compressLanes)
}

// lanesFunc compresses 16 inputs of blocks blocks each, lane j's at in[j·stride:], from cv, with
// lane j's counter ctr (+ j when perLane) and block k's flags flags[k], into out[j]: compressLanes
// (AVX-512 where there is one) or lanesScalar.
type lanesFunc func(in []byte, stride, blocks int, cv *[8]uint32, ctr uint64, perLane bool, flags *[16]uint32, out [][8]uint32)

// scratch holds a call's chunk chaining values: a 40 MB input has 40,960 of them.
var scratch = sync.Pool{New: func() any { return new([][8]uint32) }}

// sumWide hashes b (at least two chunks) with lanes, the 16-lane compression: every whole run of
// 16 chunks at once, the rest one by one, then the tree level by level, adjacent pairs merged 16
// at a time and an odd one carried up — which gives BLAKE3's tree, whose left subtrees are whole
// powers of two — and the root last.
func sumWide(b []byte, lanes16 lanesFunc) [32]byte {
	sum, _ := treeWide(b, lanes16, 0)
	return sum
}

// chunkCV is the chaining value of chunk number ctr, c (at most a chunk, not the root).
func chunkCV(c []byte, ctr uint64) [8]uint32 {
	cv := iv
	var m [16]uint32
	blocks := max(1, (len(c)+blockLen-1)/blockLen)
	for k := range blocks {
		blk := c[k*blockLen : min(len(c), (k+1)*blockLen)]
		var buf [blockLen]byte
		copy(buf[:], blk)
		for w := range m {
			m[w] = binary.LittleEndian.Uint32(buf[4*w:])
		}
		var f uint32
		if k == 0 {
			f |= chunkStart
		}
		if k == blocks-1 {
			f |= chunkEnd
		}
		cv = compress(&cv, &m, ctr, uint32(len(blk)), f)
	}
	return cv
}

// parentCV is the chaining value of the parent of l and r, with extra flags (root).
func parentCV(l, r *[8]uint32, extra uint32) [8]uint32 {
	var m [16]uint32
	copy(m[:8], l[:])
	copy(m[8:], r[:])
	return compress(&iv, &m, 0, blockLen, parent|extra)
}

// compress is BLAKE3's compression function, the first 8 words of its output.
func compress(cv *[8]uint32, m *[16]uint32, ctr uint64, n, flags uint32) [8]uint32 {
	v := [16]uint32{cv[0], cv[1], cv[2], cv[3], cv[4], cv[5], cv[6], cv[7],
		iv[0], iv[1], iv[2], iv[3], uint32(ctr), uint32(ctr >> 32), n, flags}
	s := *m
	for r := range 7 {
		g(&v, 0, 4, 8, 12, s[0], s[1])
		g(&v, 1, 5, 9, 13, s[2], s[3])
		g(&v, 2, 6, 10, 14, s[4], s[5])
		g(&v, 3, 7, 11, 15, s[6], s[7])
		g(&v, 0, 5, 10, 15, s[8], s[9])
		g(&v, 1, 6, 11, 12, s[10], s[11])
		g(&v, 2, 7, 8, 13, s[12], s[13])
		g(&v, 3, 4, 9, 14, s[14], s[15])
		if r < 6 {
			s = [16]uint32{s[2], s[6], s[3], s[10], s[7], s[0], s[4], s[13], s[1], s[11], s[12], s[5], s[9], s[14], s[15], s[8]}
		}
	}
	var out [8]uint32
	for i := range out {
		out[i] = v[i] ^ v[i+8]
	}
	return out
}

func g(v *[16]uint32, a, b, c, d int, x, y uint32) {
	v[a] += v[b] + x
	v[d] = bits.RotateLeft32(v[d]^v[a], -16)
	v[c] += v[d]
	v[b] = bits.RotateLeft32(v[b]^v[c], -12)
	v[a] += v[b] + y
	v[d] = bits.RotateLeft32(v[d]^v[a], -8)
	v[c] += v[d]
	v[b] = bits.RotateLeft32(v[b]^v[c], -7)
}

// lanesScalar is compressLanes one lane after another: the reference the tests hold the wide
// path's tree against on any CPU.
func lanesScalar(in []byte, stride, blocks int, cv *[8]uint32, ctr uint64, perLane bool, flags *[16]uint32, out [][8]uint32) {
	var m [16]uint32
	for j := range lanes {
		c := *cv
		lc := ctr
		if perLane {
			lc += uint64(j)
		}
		for k := range blocks {
			off := j*stride + k*blockLen
			for w := range m {
				m[w] = binary.LittleEndian.Uint32(in[off+4*w:])
			}
			c = compress(&c, &m, lc, blockLen, flags[k])
		}
		out[j] = c
	}
}

// cvBytes is cvs's memory as bytes: the parents' blocks, each two chaining values in a row
// (little-endian, as every platform Shoal builds for).
func cvBytes(cvs [][8]uint32) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(&cvs[0])), 32*len(cvs))
}
