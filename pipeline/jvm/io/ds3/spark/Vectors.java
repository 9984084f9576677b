package io.ds3.spark;

import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.Decimal;
import org.apache.spark.sql.vectorized.ColumnVector;
import org.apache.spark.sql.vectorized.ColumnarArray;
import org.apache.spark.sql.vectorized.ColumnarMap;
import org.apache.spark.unsafe.types.UTF8String;

/** Read-only column vectors over a decoded chunk (ChunkBatch): constants, positions, offsets
 * and views of message bytes. Nothing to free: they hold Java arrays only. */
final class Vectors {
  private Vectors() {}

  static ColumnVector constant(DataType type, Object value) {
    UTF8String s = value instanceof String str ? UTF8String.fromString(str) : null;
    long l = value instanceof Long n ? n : 0L;
    return new Base(type) {
      @Override
      public boolean hasNull() {
        return value == null;
      }

      @Override
      public int numNulls() {
        throw new UnsupportedOperationException("ds3 vectors do not count their nulls");
      }

      @Override
      public boolean isNullAt(int row) {
        return value == null;
      }

      @Override
      public long getLong(int row) {
        return l;
      }

      @Override
      public UTF8String getUTF8String(int row) {
        return s;
      }
    };
  }

  static ColumnVector longs(DataType type, long[] values) {
    return new Base(type) {
      @Override
      public long getLong(int row) {
        return values[row];
      }
    };
  }

  /** `shift` 0: each row's offset; 1: its next offset. */
  static ColumnVector offsets(DataType type, ChunkBatch.Offsets spelled, int shift) {
    return new Base(type) {
      @Override
      public UTF8String getUTF8String(int row) {
        int a = spelled.at[row + shift];
        return UTF8String.fromBytes(spelled.text, a, spelled.at[row + shift + 1] - a);
      }
    };
  }

  static ColumnVector binary(DataType type, ChunkBatch.Messages messages) {
    return new Base(type) {
      @Override
      public byte[] getBinary(int row) {
        return messages.binary(row);
      }
    };
  }

  static ColumnVector strings(DataType type, ChunkBatch.Messages messages) {
    return new Base(type) {
      @Override
      public UTF8String getUTF8String(int row) {
        return messages.string(row);
      }
    };
  }

  /** A vector of one type with no nulls; each kind overrides the getter its type uses. */
  private abstract static class Base extends ColumnVector {
    Base(DataType type) {
      super(type);
    }

    private UnsupportedOperationException wrongType() {
      return new UnsupportedOperationException("ds3 vectors hold " + dataType().simpleString());
    }

    @Override
    public void close() {}

    @Override
    public boolean hasNull() {
      return false;
    }

    @Override
    public int numNulls() {
      return 0;
    }

    @Override
    public boolean isNullAt(int row) {
      return false;
    }

    @Override
    public boolean getBoolean(int row) {
      throw wrongType();
    }

    @Override
    public byte getByte(int row) {
      throw wrongType();
    }

    @Override
    public short getShort(int row) {
      throw wrongType();
    }

    @Override
    public int getInt(int row) {
      throw wrongType();
    }

    @Override
    public long getLong(int row) {
      throw wrongType();
    }

    @Override
    public float getFloat(int row) {
      throw wrongType();
    }

    @Override
    public double getDouble(int row) {
      throw wrongType();
    }

    @Override
    public ColumnarArray getArray(int row) {
      throw wrongType();
    }

    @Override
    public ColumnarMap getMap(int row) {
      throw wrongType();
    }

    @Override
    public Decimal getDecimal(int row, int precision, int scale) {
      throw wrongType();
    }

    @Override
    public UTF8String getUTF8String(int row) {
      throw wrongType();
    }

    @Override
    public byte[] getBinary(int row) {
      throw wrongType();
    }

    @Override
    public ColumnVector getChild(int ordinal) {
      throw wrongType();
    }
  }
}
