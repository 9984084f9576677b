package io.ds3.spark;

import java.lang.invoke.MethodHandles;
import java.lang.invoke.VarHandle;
import java.nio.ByteOrder;

/** Strict UTF-8 validation, as Python's decoder judges it: no overlong forms, no surrogates,
 * nothing above U+10FFFF. (Valid text is exposed as a view of the chunk's bytes; anything else
 * is decoded with replacement, like pipeline/rows.py.) */
final class Utf8 {
  private static final VarHandle LONGS =
      MethodHandles.byteArrayViewVarHandle(long[].class, ByteOrder.LITTLE_ENDIAN);

  private Utf8() {}

  static boolean valid(byte[] b, int from, int to) {
    int i = from;
    while (i < to) {
      // ASCII runs, eight bytes at a time where they can be
      while (i + 8 <= to && (longAt(b, i) & 0x8080808080808080L) == 0) {
        i += 8;
      }
      if (i >= to) {
        return true;
      }
      int c = b[i] & 0xff;
      if (c < 0x80) {
        i++;
        continue;
      }
      int need;
      int min;
      if (c >= 0xc2 && c <= 0xdf) {
        need = 1;
        min = 0x80;
      } else if (c >= 0xe0 && c <= 0xef) {
        need = 2;
        min = 0x800;
      } else if (c >= 0xf0 && c <= 0xf4) {
        need = 3;
        min = 0x10000;
      } else {
        return false;
      }
      if (i + need >= to) {
        return false; // cut short
      }
      int cp = c & (0x3f >> need);
      for (int k = 1; k <= need; k++) {
        int d = b[i + k] & 0xff;
        if ((d & 0xc0) != 0x80) {
          return false;
        }
        cp = (cp << 6) | (d & 0x3f);
      }
      if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
        return false;
      }
      i += need + 1;
    }
    return true;
  }

  private static long longAt(byte[] b, int i) {
    return (long) LONGS.get(b, i);
  }
}
