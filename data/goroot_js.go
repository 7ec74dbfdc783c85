//go:build js

package data

import "fmt"

// GoRoot has no Go installation to find in a browser: a browser worker never reads a corpus (the
// coordinator sends it its tokens).
func GoRoot() (string, error) {
	return "", fmt.Errorf("%w: no Go installation in a browser", ErrNoData)
}
