// JPEG (TurboJPEG) and PNG (libpng's simplified API) decoding and encoding.
#include "data/image_codec.h"

#include <png.h>
#include <turbojpeg.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "core/errors.h"

namespace replica::data {

namespace {

struct TjHandle {
  tjhandle h;
  explicit TjHandle(bool compress) : h(compress ? tjInitCompress() : tjInitDecompress()) {
    if (!h) throw Error("TurboJPEG: cannot create a handle");
  }
  ~TjHandle() { tjDestroy(h); }
};

// One handle per thread and direction: creating one per image costs more than small decodes.
tjhandle decompressor() {
  thread_local TjHandle h(false);
  return h.h;
}
tjhandle compressor() {
  thread_local TjHandle h(true);
  return h.h;
}

[[noreturn]] void jpeg_fail(const std::string& source, const char* what) {
  throw IoError(source + ": not a readable JPEG (" + what + "): " + tjGetErrorStr2(decompressor()));
}

void jpeg_header(std::string_view bytes, const std::string& source, int& w, int& h, int& subsamp, int& cs) {
  // TurboJPEG 2.1 returns success without writing the outputs when the bytes end inside the
  // tables (jpeg_read_header's "tables only"): a truncated file must read as "no image size",
  // not as whatever the caller's variables held (ASan showed 1574285923x2136683003).
  w = h = 0;
  subsamp = cs = -1;
  if (tjDecompressHeader3(decompressor(), reinterpret_cast<const unsigned char*>(bytes.data()),
                          static_cast<unsigned long>(bytes.size()), &w, &h, &subsamp, &cs) != 0)
    jpeg_fail(source, "header");
  if (w <= 0 || h <= 0) throw IoError(source + ": not a readable JPEG (no image size in its header: truncated?)");
  if (static_cast<int64_t>(w) * h > (int64_t(1) << 28))
    throw IoError(source + ": JPEG of " + std::to_string(w) + "x" + std::to_string(h) + " pixels is not an image to train on");
}

RgbImage decode_jpeg(std::string_view bytes, const std::string& source, int min_w, int min_h) {
  int w, h, subsamp, cs;
  jpeg_header(bytes, source, w, h, subsamp, cs);
  // The smallest scale (of 1/8 .. 1) that still covers what the caller needs.
  int n = 0;
  const tjscalingfactor* f = tjGetScalingFactors(&n);
  tjscalingfactor best{1, 1};
  for (int i = 0; i < n && (min_w > 0 || min_h > 0); ++i) {  // no minimum: full size
    if (f[i].num > f[i].denom) continue;  // no upscaling in the DCT
    if (TJSCALED(w, f[i]) < min_w || TJSCALED(h, f[i]) < min_h) continue;
    if (static_cast<int64_t>(f[i].num) * best.denom < static_cast<int64_t>(best.num) * f[i].denom) best = f[i];
  }
  RgbImage img;
  img.full_width = w;
  img.full_height = h;
  img.width = TJSCALED(w, best);
  img.height = TJSCALED(h, best);
  const auto* src = reinterpret_cast<const unsigned char*>(bytes.data());
  const unsigned long len = static_cast<unsigned long>(bytes.size());
  if (cs == TJCS_CMYK || cs == TJCS_YCCK) {
    std::vector<uint8_t> cmyk(static_cast<size_t>(img.width) * img.height * 4);
    if (tjDecompress2(decompressor(), src, len, cmyk.data(), img.width, 0, img.height, TJPF_CMYK, 0) != 0)
      jpeg_fail(source, "CMYK data");
    // Adobe CMYK JPEGs (Photoshop's, nearly all of them) store inverted ink: 255 = none.
    img.pixels.resize(static_cast<size_t>(img.width) * img.height * 3);
    for (size_t p = 0; p < static_cast<size_t>(img.width) * img.height; ++p) {
      const unsigned k = cmyk[4 * p + 3];
      for (int c = 0; c < 3; ++c) img.pixels[3 * p + c] = static_cast<uint8_t>((cmyk[4 * p + c] * k + 127) / 255);
    }
    return img;
  }
  img.pixels.resize(static_cast<size_t>(img.width) * img.height * 3);
  if (tjDecompress2(decompressor(), src, len, img.pixels.data(), img.width, 0, img.height, TJPF_RGB, 0) != 0)
    jpeg_fail(source, "image data");
  return img;
}

RgbImage decode_png(std::string_view bytes, const std::string& source) {
  png_image im;
  std::memset(&im, 0, sizeof im);
  im.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&im, bytes.data(), bytes.size()))
    throw IoError(source + ": not a readable PNG (" + im.message + ")");
  if (im.width == 0 || im.height == 0 || static_cast<uint64_t>(im.width) * im.height > (uint64_t(1) << 28)) {
    png_image_free(&im);
    throw IoError(source + ": PNG of " + std::to_string(im.width) + "x" + std::to_string(im.height) +
                  " pixels is not an image to train on");
  }
  // RGBA, then the alpha dropped: colours stay as stored, as PIL's convert("RGB") keeps them.
  im.format = PNG_FORMAT_RGBA;
  std::vector<uint8_t> rgba(PNG_IMAGE_SIZE(im));
  if (!png_image_finish_read(&im, nullptr, rgba.data(), 0, nullptr)) {
    const std::string m = im.message;
    png_image_free(&im);
    throw IoError(source + ": damaged PNG (" + m + ")");
  }
  RgbImage img;
  img.width = img.full_width = static_cast<int>(im.width);
  img.height = img.full_height = static_cast<int>(im.height);
  img.pixels.resize(static_cast<size_t>(img.width) * img.height * 3);
  for (size_t p = 0; p < static_cast<size_t>(img.width) * img.height; ++p)
    for (int c = 0; c < 3; ++c) img.pixels[3 * p + c] = rgba[4 * p + c];
  return img;
}

std::string compress(const uint8_t* px, int w, int h, int pf, int subsamp, int quality) {
  unsigned char* out = nullptr;
  unsigned long size = 0;
  if (tjCompress2(compressor(), px, w, 0, h, pf, &out, &size, subsamp, quality, 0) != 0)
    throw Error(std::string("TurboJPEG: cannot encode: ") + tjGetErrorStr2(compressor()));
  std::string s(reinterpret_cast<char*>(out), size);
  tjFree(out);
  return s;
}

}  // namespace

ImageKind sniff_image(std::string_view b) {
  if (b.size() >= 3 && static_cast<uint8_t>(b[0]) == 0xFF && static_cast<uint8_t>(b[1]) == 0xD8 &&
      static_cast<uint8_t>(b[2]) == 0xFF)
    return ImageKind::jpeg;
  if (b.size() >= 8 && std::memcmp(b.data(), "\x89PNG\r\n\x1a\n", 8) == 0) return ImageKind::png;
  return ImageKind::unknown;
}

RgbImage decode_image(std::string_view bytes, const std::string& source, int min_width, int min_height) {
  switch (sniff_image(bytes)) {
    case ImageKind::jpeg: return decode_jpeg(bytes, source, min_width, min_height);
    case ImageKind::png: return decode_png(bytes, source);
    default:
      throw IoError(source + (bytes.empty() ? ": empty file" : ": neither JPEG nor PNG (by its first bytes)") +
                    "; remove it, or set data.skip_bad_files: true");
  }
}

void image_size(std::string_view bytes, const std::string& source, int& width, int& height) {
  if (sniff_image(bytes) == ImageKind::jpeg) {
    int subsamp, cs;
    jpeg_header(bytes, source, width, height, subsamp, cs);
    return;
  }
  if (sniff_image(bytes) == ImageKind::png) {  // the IHDR only
    png_image im;
    std::memset(&im, 0, sizeof im);
    im.version = PNG_IMAGE_VERSION;
    if (!png_image_begin_read_from_memory(&im, bytes.data(), bytes.size()))
      throw IoError(source + ": not a readable PNG (" + im.message + ")");
    width = static_cast<int>(std::min<png_uint_32>(im.width, 1u << 30));
    height = static_cast<int>(std::min<png_uint_32>(im.height, 1u << 30));
    png_image_free(&im);
    return;
  }
  decode_image(bytes, source);  // neither: the same error as decoding it
}

std::string encode_jpeg(const uint8_t* rgb, int w, int h, int quality) { return compress(rgb, w, h, TJPF_RGB, TJSAMP_420, quality); }
std::string encode_jpeg_gray(const uint8_t* g, int w, int h, int quality) { return compress(g, w, h, TJPF_GRAY, TJSAMP_GRAY, quality); }
std::string encode_jpeg_cmyk(const uint8_t* c, int w, int h, int quality) { return compress(c, w, h, TJPF_CMYK, TJSAMP_444, quality); }

std::string encode_png(const uint8_t* px, int w, int h, int channels) {
  png_image im;
  std::memset(&im, 0, sizeof im);
  im.version = PNG_IMAGE_VERSION;
  im.width = static_cast<png_uint_32>(w);
  im.height = static_cast<png_uint_32>(h);
  im.format = channels == 1 ? PNG_FORMAT_GRAY : channels == 2 ? PNG_FORMAT_GA : channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_RGBA;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&im, nullptr, &size, 0, px, 0, nullptr)) throw Error(std::string("libpng: ") + im.message);
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&im, out.data(), &size, 0, px, 0, nullptr)) throw Error(std::string("libpng: ") + im.message);
  out.resize(size);
  return out;
}

}  // namespace replica::data
