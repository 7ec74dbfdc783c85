package sched

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestPure enforces doc.go: sched's non-test code imports no network, database, file, clock or
// synchronisation package, nothing outside the standard library but model, and starts no
// goroutines.
func TestPure(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	forbidden := func(path string) bool {
		first, _, _ := strings.Cut(path, "/")
		switch {
		case path == "github.com/shoal-ml/shoal/model":
			return false
		case strings.Contains(first, "."), path == "C":
			return true // outside the standard library
		}
		for _, p := range []string{"net", "database", "os", "syscall", "time", "sync", "io/fs", "plugin", "unsafe"} {
			if path == p || strings.HasPrefix(path, p+"/") {
				return true
			}
		}
		return false
	}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			if path, _ := strconv.Unquote(imp.Path.Value); forbidden(path) {
				t.Errorf("%s imports %s: sched must stay pure (doc.go)", name, path)
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			if g, ok := n.(*ast.GoStmt); ok {
				t.Errorf("%s: go statement at %v: sched starts no goroutines (doc.go)", name, fset.Position(g.Pos()))
			}
			return true
		})
	}
}
