// Helpers of one integer type T (U: its unsigned type): division by zero gives 0 and never traps (nor does
// MIN / -1), Python's signs for floor division and remainder, power by squaring, clip.
FN T T_floordiv(T a, T b) {
  if (b == (T)0) return (T)0;
  if ((T)(b + (T)1) == (T)0 && (T)-1 < (T)0) return (T)((U)0 - (U)a);
  T q = (T)(a / b);
  if ((T)-1 < (T)0 && (T)(a % b) != (T)0 && ((a < (T)0) != (b < (T)0))) q -= (T)1;
  return q;
}
FN T T_rem(T a, T b) {
  if (b == (T)0) return (T)0;
  if ((T)(b + (T)1) == (T)0 && (T)-1 < (T)0) return (T)0;
  T r = (T)(a % b);
  if ((T)-1 < (T)0 && r != (T)0 && ((r < (T)0) != (b < (T)0))) r += b;
  return r;
}
FN T T_pow(T a, T b) {
  if ((T)-1 < (T)0 && b < (T)0) return (T)(a == (T)1 ? 1 : (a == (T)-1 ? ((b & (T)1) ? -1 : 1) : 0));
  U r = 1, base = (U)a;
  U64 e = (U64)b;
  while (e) { if (e & 1) r *= base; base *= base; e >>= 1; }
  return (T)r;
}
FN T T_clip(T x, T lo, T hi) {
  T r = x < lo ? lo : x;
  return r > hi ? hi : r;
}
