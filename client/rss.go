package client

import (
	"bytes"
	"os"
	"strconv"
)

// peakRSS is the most resident memory this process has held (Linux's VmHWM), in bytes; 0 where
// the kernel does not say (other systems, a browser tab). A worker logs it against the memory it
// offered, so that the planner's memory model can be checked against the real peak.
func peakRSS() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for line := range bytes.SplitSeq(b, []byte("\n")) {
		if v, ok := bytes.CutPrefix(line, []byte("VmHWM:")); ok {
			kb, err := strconv.ParseInt(string(bytes.TrimSuffix(bytes.TrimSpace(v), []byte(" kB"))), 10, 64)
			if err != nil {
				return 0
			}
			return kb << 10
		}
	}
	return 0
}
