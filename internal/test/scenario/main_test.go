package scenario

import (
	"testing"

	"github.com/mpmr/mpmr/internal/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }
