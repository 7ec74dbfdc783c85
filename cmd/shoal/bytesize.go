package main

import (
	"flag"
	"fmt"
	"math"
	"strconv"
	"strings"
)

// byteUnits are the suffixes a byte count may carry: SI (powers of 1000) and IEC (powers of
// 1024), as people write them for RAM ("8GiB") and for disks and networks ("512MB").
var byteUnits = map[string]float64{
	"": 1, "b": 1,
	"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
	"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}

// parseBytes reads a positive byte count: plain bytes ("8000000000") or a number with a unit
// ("8GiB", "512MB", "1.5 GB"; units in any case). Zero, negatives, fractions of a byte and
// anything else are refused: a worker offering nothing, or a typo taken for a count, would only
// fail later and less clearly.
func parseBytes(s string) (int64, error) {
	t := strings.TrimSpace(s)
	i := 0
	for i < len(t) && (t[i] >= '0' && t[i] <= '9' || t[i] == '.') {
		i++
	}
	num, unit := t[:i], strings.ToLower(strings.TrimSpace(t[i:]))
	mult, ok := byteUnits[unit]
	if num == "" || !ok {
		if strings.HasPrefix(t, "-") {
			return 0, fmt.Errorf("%q: a byte count must be positive", s)
		}
		return 0, fmt.Errorf("%q: want a byte count such as 8GiB, 512MB, 1.5GB or 8000000000 (units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)", s)
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil {
		return 0, fmt.Errorf("%q: %q is not a number", s, num)
	}
	b := v * mult
	switch {
	case b <= 0:
		return 0, fmt.Errorf("%q: a byte count must be positive", s)
	case b >= math.MaxInt64:
		return 0, fmt.Errorf("%q: too large", s)
	case b != math.Trunc(b):
		return 0, fmt.Errorf("%q is not a whole number of bytes", s)
	}
	return int64(b), nil
}

// formatBytes writes n the shortest way parseBytes reads back exactly: in the largest IEC unit
// that divides it, else in bytes.
func formatBytes(n int64) string {
	for _, u := range []struct {
		name string
		size int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n != 0 && n%u.size == 0 {
			return strconv.FormatInt(n/u.size, 10) + u.name
		}
	}
	return strconv.FormatInt(n, 10)
}

// byteSize is a flag holding a byte count in human units (parseBytes). Zero is its unset value:
// a flag given on the command line is always positive.
type byteSize int64

func (b *byteSize) String() string { return formatBytes(int64(*b)) }

func (b *byteSize) Set(s string) error {
	n, err := parseBytes(s)
	if err != nil {
		return err
	}
	*b = byteSize(n)
	return nil
}

// bytesFlag defines a byteSize flag with default def (0: none).
func bytesFlag(fs *flag.FlagSet, name string, def int64, usage string) *byteSize {
	b := byteSize(def)
	fs.Var(&b, name, usage)
	return &b
}

// bitUnits are the suffixes of a rate in bits per second, as network links are sold.
var bitUnits = map[string]float64{"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}

// parseRate reads a positive upload rate in bytes per second: bits ("10Mbit", "10Mbit/s",
// "10Mbps") or bytes ("2MB/s", "512KiB/s", "2MB"). A bare number is refused: bits or bytes is a factor
// of eight, and a link cap taken the wrong way is one the volunteer would not notice.
func parseRate(s string) (float64, error) {
	t := strings.TrimSpace(s)
	i := 0
	for i < len(t) && (t[i] >= '0' && t[i] <= '9' || t[i] == '.') {
		i++
	}
	num, unit := t[:i], strings.ToLower(strings.TrimSpace(t[i:]))
	bad := fmt.Errorf("%q: want a rate such as 10Mbit, 2MB/s or 512KiB/s (bits: bit, kbit, Mbit, Gbit or bps, kbps, Mbps, Gbps; bytes: B, kB, MB, GB, KiB, MiB, GiB, per second)", s)
	if strings.HasPrefix(t, "-") {
		return 0, fmt.Errorf("%q: a rate must be positive", s)
	}
	var mult float64
	if m, ok := bitUnits[strings.TrimSuffix(unit, "/s")]; ok && !strings.HasSuffix(unit, "bps/s") {
		mult = m / 8
	} else if b := strings.TrimSuffix(unit, "/s"); b != "" {
		m, ok := byteUnits[b]
		if !ok {
			return 0, bad
		}
		mult = m
	}
	if num == "" || mult == 0 {
		return 0, bad
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil {
		return 0, fmt.Errorf("%q: %q is not a number", s, num)
	}
	r := v * mult
	switch {
	case r <= 0:
		return 0, fmt.Errorf("%q: a rate must be positive", s)
	case r < 1024:
		return 0, fmt.Errorf("%q: under 1KiB/s, too slow to move a tensor", s)
	case math.IsInf(r, 0) || r > 1e15:
		return 0, fmt.Errorf("%q: too large", s)
	}
	return r, nil
}

// rateFlag is --max-upload: bytes per second, 0 unset.
type rateFlag struct {
	bps  float64
	text string
}

func (f *rateFlag) String() string {
	if f == nil {
		return ""
	}
	return f.text
}

func (f *rateFlag) Set(s string) error {
	r, err := parseRate(s)
	if err != nil {
		return err
	}
	f.bps, f.text = r, strings.TrimSpace(s)
	return nil
}
