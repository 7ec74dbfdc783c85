package client

import (
	"bytes"
	"crypto/ed25519"
	crand "crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
)

// identityHeader opens an identity file; the rest is the key's 32-byte seed in base64.
const identityHeader = "shoal-identity-v1 "

// DefaultIdentityPath is where `shoal worker` keeps its volunteer's key when --identity does not
// say: shoal/identity in the user's configuration directory.
func DefaultIdentityPath() (string, error) {
	dir, err := os.UserConfigDir()
	if err != nil {
		return "", fmt.Errorf("no configuration directory for the identity (give --identity FILE): %w", err)
	}
	return filepath.Join(dir, "shoal", "identity"), nil
}

// LoadIdentity reads the volunteer's key from path, or makes one and writes it there (mode 0600,
// its directory 0700) when the file does not exist. The file holds nothing but the key: no name,
// no address. A file that others may read is refused, as ssh refuses such a private key: whoever
// reads it can earn, and lose, this volunteer's credit. created says the key is new.
func LoadIdentity(path string) (key ed25519.PrivateKey, created bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return createIdentity(path)
	}
	if err != nil {
		return nil, false, fmt.Errorf("identity: %w", err)
	}
	if runtime.GOOS != "windows" {
		if fi, err := os.Stat(path); err == nil && fi.Mode().Perm()&0o077 != 0 {
			return nil, false, fmt.Errorf("identity %s: mode %v lets others read the key; chmod 600 it", path, fi.Mode().Perm())
		}
	}
	seed, ok := bytes.CutPrefix(bytes.TrimSpace(b), []byte(identityHeader))
	if !ok {
		return nil, false, fmt.Errorf("identity %s: not a shoal identity file (want %q and a key)", path, identityHeader)
	}
	raw := make([]byte, base64.StdEncoding.DecodedLen(len(seed)))
	n, err := base64.StdEncoding.Decode(raw, seed)
	if err != nil || n != ed25519.SeedSize {
		return nil, false, fmt.Errorf("identity %s: the key is not %d bytes of base64", path, ed25519.SeedSize)
	}
	return ed25519.NewKeyFromSeed(raw[:n]), false, nil
}

func createIdentity(path string) (ed25519.PrivateKey, bool, error) {
	seed := make([]byte, ed25519.SeedSize)
	if _, err := crand.Read(seed); err != nil {
		return nil, false, fmt.Errorf("identity: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, false, fmt.Errorf("identity: %w", err)
	}
	// Written aside and linked into place, which fails if the file exists: two workers starting
	// at once with one file end up with one key, the first's, and never read half a file.
	f, err := os.CreateTemp(filepath.Dir(path), ".identity-*")
	if err != nil {
		return nil, false, fmt.Errorf("identity: %w", err)
	}
	defer os.Remove(f.Name())
	_, err = fmt.Fprintf(f, "%s%s\n", identityHeader, base64.StdEncoding.EncodeToString(seed))
	if err = errors.Join(err, f.Chmod(0o600), f.Sync(), f.Close()); err != nil {
		return nil, false, fmt.Errorf("identity: %w", err)
	}
	if err := os.Link(f.Name(), path); errors.Is(err, fs.ErrExist) {
		k, _, err := LoadIdentity(path)
		return k, false, err
	} else if err != nil {
		return nil, false, fmt.Errorf("identity: %w", err)
	}
	return ed25519.NewKeyFromSeed(seed), true, nil
}
